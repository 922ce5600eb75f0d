// Causal attention over the KV cache (attention_forward: the CPU target's
// prefill, decode and verify) and the drafter's unmasked block attention
// (bidirectional_attention_forward) share one kernel; the latter's backward
// (training) uses OpenBLAS.
//
// The kernel: each chunk of work is one KV head and a block of query rows; its
// queries are the group = heads / kv_heads query heads of that KV head for
// each row of the block (the grouped-query heads share every key and value
// row load). Three passes per chunk:
//   1. scores[j, t] = scale * q_j . k_t for every query j and position t of
//      the block's longest row: "dot" tiles of Keys positions x Queries
//      queries, vector accumulators along head_dim, lane sums by simd.h's
//      fixed tree (the matmul's [out, in] tile, with keys for weight rows);
//   2. per query, over its own visible positions: the maximum, exp(s - max)
//      (simd::exp), and their sum (vector accumulators, fixed lane tree);
//   3. out_j = (sum_t p_j[t] v_t) / total_j: "axpy" tiles of Queries queries x
//      Vectors head_dim vectors, each value row loaded once per tile.
// Chunks are spread over the worker pool (parallel.h).
//
// Invariance (what lossless speculative decoding needs): every operation on
// query j's data is the same sequence whatever else shares its chunk, tile or
// thread: fixed-width accumulators over head_dim in order, positions in
// order, each query's softmax over exactly its visible positions (padded to
// a whole vector the same way for the same visible length), and values
// accumulated per query in position order, one FMA per position. So the
// output for a token at position p is bit-identical whether it is the single
// row of a decode step or row r of a k-row verify, and whatever the thread
// count (tests/test_attention.cpp checks this). It does depend on the
// instruction set (vector width, FMA), which is fixed for a process.
#include "kernels/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"

namespace dspark::cpu {
namespace {

using simd::Floats;
using simd::load;
using simd::store;
using simd::sum_lanes;

// ---- the problem and its chunks ------------------------------------------------

struct AttentionProblem {
  float* out;
  const float* q;
  const float* keys;  // positions [0, context_rows)
  const float* values;
  const float* block_keys;  // positions from context_rows on (the drafter's block); null when keys holds all
  const float* block_values;
  int context_rows;
  int rows, first_position, heads, kv_heads, head_dim, group;
  int kv_rows;     // 0: causal (row r sees first_position + r + 1 positions); else every row sees kv_rows
  long kv_stride;  // floats between consecutive positions of the cache
  float scale;
  int block_rows;  // query rows per chunk
  int row_blocks;  // chunks per KV head
};

// One chunk: KV head `kv_head`, rows [row, row + count). Query j (0 <= j <
// count * group) is row row + j / group, head kv_head * group + j % group.
struct Chunk {
  const AttentionProblem& p;
  int kv_head, row, count;
  float* scores;  // [count * group, stride]
  long stride;    // floats per query's scores: the longest row's visible positions, rounded up to a vector

  long query_offset(int j) const {
    return (long(row + j / p.group) * p.heads + long(kv_head) * p.group + j % p.group) * p.head_dim;
  }
  const float* query(int j) const { return p.q + query_offset(j); }
  float* output(int j) const { return p.out + query_offset(j); }
  int visible(int j) const { return p.kv_rows ? p.kv_rows : p.first_position + row + j / p.group + 1; }
  const float* key(int t) const {
    return (t < p.context_rows ? p.keys + t * p.kv_stride : p.block_keys + (t - p.context_rows) * p.kv_stride) +
           long(kv_head) * p.head_dim;
  }
  const float* value(int t) const {
    return (t < p.context_rows ? p.values + t * p.kv_stride : p.block_values + (t - p.context_rows) * p.kv_stride) +
           long(kv_head) * p.head_dim;
  }
};

// Per-thread scratch: the chunk's scores and its softmax totals. Grows to the
// largest chunk seen and is kept (a decode step runs ~8 of these per layer).
struct Scratch {
  std::vector<float> scores, totals;
};
Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// ---- tile shapes per instruction set -----------------------------------------------

// Registers: the vector registers the accumulators and operands may use.
// Score tiles: up to score_queries queries x (registers - queries) / (queries
// + 1) positions (the matmul's dot tile). Value tiles: value_vectors head_dim
// vectors x (registers - 1 - vectors) / vectors queries.
struct AttentionTiles {
  int width;  // floats per vector
  int registers, score_queries, value_vectors;
};
constexpr AttentionTiles kAvx512Attention{16, 30, 4, 4};
constexpr AttentionTiles kAvx2Attention{8, 15, 3, 2};
constexpr AttentionTiles kBaselineAttention{4, 15, 3, 2};

constexpr int score_keys_for(int registers, int queries) {
  return std::clamp((registers - queries) / (queries + 1), 1, 8);
}
constexpr int value_queries_for(int registers, int vectors) {
  return std::clamp((registers - 1 - vectors) / vectors, 1, 8);
}

// ---- pass 1: scores ------------------------------------------------------------------

// scores[j + i, t + k] = scale * q_{j+i} . k_{t+k} for Keys positions and
// Queries queries.
template <int W, int Keys, int Queries>
[[gnu::always_inline]] inline void score_tile(const Chunk& c, int t, int j) {
  using V = typename Floats<W>::Vector;
  const int head_dim = c.p.head_dim;
  const float* key[Keys];
  const float* query[Queries];
#pragma GCC unroll 8
  for (int k = 0; k < Keys; ++k) key[k] = c.key(t + k);
#pragma GCC unroll 8
  for (int i = 0; i < Queries; ++i) query[i] = c.query(j + i);
  V sums[Keys * Queries];  // [key][query]
#pragma GCC unroll 64
  for (int k = 0; k < Keys * Queries; ++k) sums[k] = V{};
  for (int d = 0; d < head_dim; d += W) {
    V k_vector[Keys];
#pragma GCC unroll 8
    for (int k = 0; k < Keys; ++k) k_vector[k] = load<V>(key[k] + d);
#pragma GCC unroll 8
    for (int i = 0; i < Queries; ++i) {
      const V q_vector = load<V>(query[i] + d);
#pragma GCC unroll 8
      for (int k = 0; k < Keys; ++k) sums[k * Queries + i] += k_vector[k] * q_vector;
    }
  }
  float totals[Keys * Queries];
  sum_lanes<W, 0>(sums, totals);
#pragma GCC unroll 8
  for (int k = 0; k < Keys; ++k)
#pragma GCC unroll 8
    for (int i = 0; i < Queries; ++i) c.scores[(j + i) * c.stride + t + k] = totals[k * Queries + i] * c.p.scale;
}

// All positions of the chunk against queries [j, j + Queries).
template <int W, int Registers, int Queries>
[[gnu::always_inline]] inline void score_queries(const Chunk& c, int j, int positions) {
  constexpr int kKeys = score_keys_for(Registers, Queries);
  int t = 0;
  for (; t + kKeys <= positions; t += kKeys) score_tile<W, kKeys, Queries>(c, t, j);
  for (; t < positions; ++t) score_tile<W, 1, Queries>(c, t, j);
}

// Queries in balanced blocks of at most MaxQueries (Queries or Queries - 1
// each), picking the tile for the largest block.
template <int W, int Registers, int Queries>
[[gnu::always_inline]] inline void score_blocks(const Chunk& c, int queries, int blocks, int largest, int positions) {
  if constexpr (Queries > 1)
    if (largest < Queries) return score_blocks<W, Registers, Queries - 1>(c, queries, blocks, largest, positions);
  for (int block = 0, j = 0; block < blocks; ++block) {
    const int count = (queries - j) / (blocks - block) + ((queries - j) % (blocks - block) != 0);
    if (count == Queries)
      score_queries<W, Registers, Queries>(c, j, positions);
    else if constexpr (Queries > 1)
      score_queries<W, Registers, Queries - 1>(c, j, positions);
    j += count;
  }
}

// ---- pass 2: softmax numerators and totals ----------------------------------------

// Query j's scores over its visible positions become exp(s - max); returns
// their sum. The row is padded to a whole vector with -inf (weight 0), so the
// same visible length always takes the same steps. simd::exp flushes weights
// below e^-87.3 (< 1e-38 of the maximum's) to 0.
template <int W>
[[gnu::always_inline]] inline float softmax_numerators(float* scores, int visible) {
  using V = typename Floats<W>::Vector;
  const int padded = (visible + W - 1) / W * W;
  for (int t = visible; t < padded; ++t) scores[t] = -INFINITY;
  V maximum = load<V>(scores);
  for (int t = W; t < padded; t += W) {
    const V x = load<V>(scores + t);
    maximum = x > maximum ? x : maximum;
  }
  float largest = maximum[0];
#pragma GCC unroll 16
  for (int i = 1; i < W; ++i) largest = std::max(largest, float(maximum[i]));
  V total[1] = {V{}};
  for (int t = 0; t < padded; t += W) {
    const V e = simd::exp<W>(load<V>(scores + t) - largest);
    store(scores + t, e);
    total[0] += e;
  }
  float sum;
  sum_lanes<W, 0>(total, &sum);
  return sum;
}

// ---- pass 3: weighted values -------------------------------------------------------

// out_{j+i}[d .. d + Vectors W) = Σ_t p_{j+i}[t] v_t[...] / total_{j+i}, t
// over each query's own visible positions, in order.
template <int W, int Vectors, int Queries>
[[gnu::always_inline]] inline void value_tile(const Chunk& c, const float* totals, int d, int j) {
  using V = typename Floats<W>::Vector;
  const float* weights[Queries];
  int visible[Queries];
#pragma GCC unroll 8
  for (int i = 0; i < Queries; ++i) weights[i] = c.scores + (j + i) * c.stride, visible[i] = c.visible(j + i);
  V sums[Queries][Vectors];
#pragma GCC unroll 8
  for (int i = 0; i < Queries; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < Vectors; ++v) sums[i][v] = V{};
  // Queries are in row order, so the first sees the fewest positions.
  const int common = visible[0], longest = visible[Queries - 1];
  int t = 0;
  for (; t < common; ++t) {
    const float* value = c.value(t) + d;
    V v_vector[Vectors];
#pragma GCC unroll 8
    for (int v = 0; v < Vectors; ++v) v_vector[v] = load<V>(value + v * W);
#pragma GCC unroll 8
    for (int i = 0; i < Queries; ++i) {
      const float weight = weights[i][t];
#pragma GCC unroll 8
      for (int v = 0; v < Vectors; ++v) sums[i][v] += v_vector[v] * weight;
    }
  }
  for (; t < longest; ++t) {  // the later rows' extra positions
    const float* value = c.value(t) + d;
    V v_vector[Vectors];
#pragma GCC unroll 8
    for (int v = 0; v < Vectors; ++v) v_vector[v] = load<V>(value + v * W);
#pragma GCC unroll 8
    for (int i = 0; i < Queries; ++i)
      if (t < visible[i]) {
        const float weight = weights[i][t];
#pragma GCC unroll 8
        for (int v = 0; v < Vectors; ++v) sums[i][v] += v_vector[v] * weight;
      }
  }
#pragma GCC unroll 8
  for (int i = 0; i < Queries; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < Vectors; ++v) store(c.output(j + i) + d + v * W, sums[i][v] / totals[j + i]);
}

template <int W, int Vectors, int Queries>
[[gnu::always_inline]] inline void value_queries(const Chunk& c, const float* totals, int queries) {
  int j = 0;
  for (; j + Queries <= queries; j += Queries)
    for (int d = 0; d < c.p.head_dim; d += Vectors * W) value_tile<W, Vectors, Queries>(c, totals, d, j);
  for (; j < queries; ++j)
    for (int d = 0; d < c.p.head_dim; d += Vectors * W) value_tile<W, Vectors, 1>(c, totals, d, j);
}

// ---- one chunk ----------------------------------------------------------------------

template <int W, const AttentionTiles& Tiles>
[[gnu::always_inline]] inline void attention_chunk(const AttentionProblem& p, int chunk) {
  const int kv_head = chunk / p.row_blocks, block = chunk % p.row_blocks;
  const int row = block * p.block_rows, count = std::min(p.block_rows, p.rows - row);
  const int queries = count * p.group, positions = p.kv_rows ? p.kv_rows : p.first_position + row + count;
  Scratch& scratch = thread_scratch();
  const long stride = (positions + W - 1) / W * W;
  if (scratch.scores.size() < size_t(queries * stride)) scratch.scores.resize(size_t(queries * stride));
  if (scratch.totals.size() < size_t(queries)) scratch.totals.resize(queries);
  const Chunk c{p, kv_head, row, count, scratch.scores.data(), stride};

  constexpr int kMaxQueries = Tiles.score_queries;
  const int blocks = (queries + kMaxQueries - 1) / kMaxQueries;
  const int largest = (queries + blocks - 1) / blocks;
  score_blocks<W, Tiles.registers, kMaxQueries>(c, queries, blocks, largest, positions);

  for (int j = 0; j < queries; ++j) scratch.totals[j] = softmax_numerators<W>(c.scores + j * stride, c.visible(j));

  // head_dim vectors per value tile: the most that divides head_dim / W.
  const int vectors = p.head_dim / W;
  if (Tiles.value_vectors >= 4 && vectors % 4 == 0)
    value_queries<W, 4, value_queries_for(Tiles.registers, 4)>(c, scratch.totals.data(), queries);
  else if (Tiles.value_vectors >= 2 && vectors % 2 == 0)
    value_queries<W, 2, value_queries_for(Tiles.registers, 2)>(c, scratch.totals.data(), queries);
  else
    value_queries<W, 1, value_queries_for(Tiles.registers, 1)>(c, scratch.totals.data(), queries);
}

// The vector width: the instruction set's, or the widest narrower power of two
// that divides head_dim (a property of the model, never of the call).
template <const AttentionTiles& Tiles>
[[gnu::always_inline]] inline void attention_chunk(const void* problem, int chunk) {
  const AttentionProblem& p = *static_cast<const AttentionProblem*>(problem);
  if constexpr (Tiles.width >= 16)
    if (p.head_dim % 16 == 0) return attention_chunk<16, Tiles>(p, chunk);
  if constexpr (Tiles.width >= 8)
    if (p.head_dim % 8 == 0) return attention_chunk<8, Tiles>(p, chunk);
  if (p.head_dim % 4 == 0) return attention_chunk<4, Tiles>(p, chunk);
  if (p.head_dim % 2 == 0) return attention_chunk<2, Tiles>(p, chunk);
  attention_chunk<1, Tiles>(p, chunk);
}
__attribute__((target("arch=x86-64-v4"))) void attention_chunk_avx512(const void* problem, int chunk) {
  attention_chunk<kAvx512Attention>(problem, chunk);
}
__attribute__((target("arch=x86-64-v3"))) void attention_chunk_avx2(const void* problem, int chunk) {
  attention_chunk<kAvx2Attention>(problem, chunk);
}
void attention_chunk_baseline(const void* problem, int chunk) { attention_chunk<kBaselineAttention>(problem, chunk); }

// Chunks smaller than this many multiply-adds (a few microseconds) are not
// worth handing to a worker: a short decode step's attention runs on the
// calling thread alone.
constexpr long kMinChunkWork = 1L << 16;
// Longest row block: bounds the scratch (queries x positions floats).
constexpr int kMaxBlockRows = 16;

// Cuts p into chunks (KV head x row block) and runs them on the pool, or on
// the calling thread alone when the whole is small. `work`: multiply-adds.
void run_attention(AttentionProblem& p, long work) {
  const int threads = parallel_threads();
  // Row blocks per KV head: about one chunk per thread, none of them tiny.
  // Fewer, larger chunks beat finer claiming here: a chunk's queries share
  // every key and value load, and with 3 queries (one row of the demo target)
  // those loads, not the FMAs, are the cost (bench/attention_benchmark.cpp:
  // 2 rows over 2048 positions took 102 us as 4 chunks, 61 us as 2).
  const long most_chunks = std::min<long>(threads, work / kMinChunkWork);
  int row_blocks = threads == 1 ? 1 : int(std::clamp<long>((most_chunks + p.kv_heads - 1) / p.kv_heads, 1, p.rows));
  row_blocks = std::max(row_blocks, (p.rows + kMaxBlockRows - 1) / kMaxBlockRows);
  p.block_rows = (p.rows + row_blocks - 1) / row_blocks;
  p.row_blocks = (p.rows + p.block_rows - 1) / p.block_rows;
  const int chunks = p.kv_heads * p.row_blocks;
  const ParallelTask task = for_matmul_isa(attention_chunk_avx512, attention_chunk_avx2, attention_chunk_baseline);
  if (threads == 1 || work < 2 * kMinChunkWork)
    for (int chunk = 0; chunk < chunks; ++chunk) task(&p, chunk);
  else
    parallel_run(task, &p, chunks);
}

}  // namespace

void attention_forward(float* out, const float* q, const float* keys, const float* values, int rows, int first_position,
                       int heads, int kv_heads, int head_dim, float* scores) {
  if (rows <= 0) return;
  AttentionProblem p{out,
                     q,
                     keys,
                     values,
                     nullptr,
                     nullptr,
                     std::numeric_limits<int>::max(),
                     rows,
                     first_position,
                     heads,
                     kv_heads,
                     head_dim,
                     heads / kv_heads,
                     0,
                     long(kv_heads) * head_dim,
                     1.0f / std::sqrt(static_cast<float>(head_dim)),
                     0,
                     0};
  // Multiply-adds: two per (query, visible position, head_dim element).
  run_attention(p, 2L * heads * head_dim * (long(rows) * first_position + long(rows) * (rows + 1) / 2));
}

void bidirectional_attention_forward(float* out, const float* q, const float* keys, const float* values, int rows,
                                     int kv_rows, int heads, int head_dim, float* scores) {
  bidirectional_attention_forward(out, q, keys, values, kv_rows, nullptr, nullptr, 0, rows, heads, head_dim);
}

void bidirectional_attention_forward(float* out, const float* q, const float* context_keys, const float* context_values,
                                     int context_rows, const float* block_keys, const float* block_values,
                                     int block_rows, int rows, int heads, int head_dim) {
  if (rows <= 0) return;
  const int kv_rows = context_rows + block_rows;
  DSPARK_CHECK(kv_rows > 0, "unmasked attention needs at least one key");
  AttentionProblem p{out,
                     q,
                     context_keys,
                     context_values,
                     block_keys,
                     block_values,
                     context_rows,
                     rows,
                     0,
                     heads,
                     heads,
                     head_dim,
                     1,
                     kv_rows,
                     long(heads) * head_dim,
                     1.0f / std::sqrt(static_cast<float>(head_dim)),
                     0,
                     0};
  run_attention(p, 2L * heads * head_dim * rows * kv_rows);
}

void bidirectional_attention_backward(float* dq, float* dkeys, float* dvalues, const float* dout, const float* q,
                                      const float* keys, const float* values, int rows, int kv_rows, int heads,
                                      int head_dim, float* scratch) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int stride = heads * head_dim;              // one head's rows are `stride` floats apart
  float* probs = scratch;                           // [rows, kv_rows] P = softmax(scale Q K^T)
  float* dscores = scratch + long(rows) * kv_rows;  // [rows, kv_rows] dP, then dS
  for (int head = 0; head < heads; ++head) {
    const long offset = long(head) * head_dim;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, kv_rows, head_dim, scale, q + offset, stride,
                keys + offset, stride, 0.0f, probs, kv_rows);
    for (int row = 0; row < rows; ++row) {
      float* p = probs + long(row) * kv_rows;
      const float maximum = *std::max_element(p, p + kv_rows);
      float total = 0.0f;
      for (int t = 0; t < kv_rows; ++t) total += (p[t] = std::exp(p[t] - maximum));
      for (int t = 0; t < kv_rows; ++t) p[t] /= total;
    }
    // dP = dO V^T;  dS = P ⊙ (dP - rowsum(P ⊙ dP)), times the scale that multiplied Q K^T.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, kv_rows, head_dim, 1.0f, dout + offset, stride,
                values + offset, stride, 0.0f, dscores, kv_rows);
    for (int row = 0; row < rows; ++row) {
      const float* p = probs + long(row) * kv_rows;
      float* ds = dscores + long(row) * kv_rows;
      float dot = 0.0f;
      for (int t = 0; t < kv_rows; ++t) dot += p[t] * ds[t];
      for (int t = 0; t < kv_rows; ++t) ds[t] = scale * p[t] * (ds[t] - dot);
    }
    // dQ += dS K;  dK += dS^T Q;  dV += P^T dO.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, head_dim, kv_rows, 1.0f, dscores, kv_rows,
                keys + offset, stride, 1.0f, dq + offset, stride);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, kv_rows, head_dim, rows, 1.0f, dscores, kv_rows, q + offset,
                stride, 1.0f, dkeys + offset, stride);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, kv_rows, head_dim, rows, 1.0f, probs, kv_rows, dout + offset,
                stride, 1.0f, dvalues + offset, stride);
  }
}

}  // namespace dspark::cpu
