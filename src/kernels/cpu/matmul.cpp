// The forwards' two paths (see matmul.h): OpenBLAS for many rows, and for few
// rows an own kernel (for bf16 weights, at every row count).
//
// Why an own kernel: for 2-16 rows sgemm first packs the whole weight matrix
// (reads it and writes a copy, then reads the copy), so a verify of k tokens
// moved ~3x the weight bytes of a decode step and cost 2-3.5x a step on a
// 2-core machine whose decode is memory-bound. The small-row kernel reads each
// weight element once from memory and uses it for every row while it sits in
// L1 (registers, in fact): the extra rows cost FLOPs, not bytes.
//
// Three tiles:
//   [out, in] f32 (matmul_forward): a tile of F weight rows x R activation
//     rows keeps F*R vector accumulators of partial dot products along `in`,
//     summed across lanes at the end (the "dot" tile).
//   [in, out] f32 (matmul_in_out_forward): a tile of R rows x C output
//     columns keeps R*C/W vector accumulators; each weight row segment is
//     loaded once and multiplied by R broadcast activations (the "axpy" tile).
//   bf16, either layout (given weight_bf16): the axpy tile's shape over
//     pairs of inputs, the weights in panels of 16 output features
//     (pack_bf16_rows, pack_bf16_columns), widened as they load; with
//     bf16_products() the activations are rounded to bf16 first, and on
//     AVX-512 BF16 one vdpbf16ps applies a pair of inputs to 16 features
//     (the "pairs" tile). Each output is the plain sequential sum over `in`,
//     so it has no horizontal sums at all, and the same bits for every row
//     count and on every instruction set with FMA. With AMX (Intel's tile
//     multiply) bf16 products of `in` a multiple of 32 run on the tiles
//     instead, at one cost for 1-16 rows (bits of their own, row by row the
//     same at every row count; below).
// Tile shapes are chosen per row count so the accumulators fill most of the
// vector registers (16 with AVX2, 32 with AVX-512) without spilling.
//
// Instruction sets: the kernels are written once with GCC vector extensions
// and compiled three times, for x86-64-v4 (AVX-512, 16 floats a vector),
// x86-64-v3 (AVX2 + FMA, 8) and the baseline (SSE2, 4); the widest the CPU
// supports is picked once at run time, so the binary runs on any x86-64.
// FMA contraction comes from GCC's default -ffp-contract=fast (GNU dialect).
//
// Threads: a product is cut into chunks of output features that the calling
// thread and the workers of the shared pool (parallel.h) claim one at a time.
#include "kernels/cpu/matmul.h"

#include <cblas.h>
#include <immintrin.h>  // __builtin_ia32_dpbf16ps_v16sf (AVX-512 BF16), the AMX tile intrinsics
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"

namespace dspark::cpu {
namespace {

// Products are split into chunks of at least this many multiply-adds (a few
// microseconds); smaller ones run on the calling thread alone, where handing
// work to a worker would cost more than it saves.
constexpr long kMinChunkWork = 1L << 16;

using simd::Floats;
using simd::load;
using simd::store;
using simd::sum_lanes;
using simd::Words;

// ---- tile shapes per instruction set ---------------------------------------------

// Register budgets and row blocks, measured on Zen 4 (docs/PERF.md): for dot
// tiles with AVX-512's 32 registers, blocks of 4 rows and 5 weight rows (20
// accumulators, 9 operand vectors) beat 3, 5 and 6 rows; with AVX2's 16, 3
// rows x 3 weight rows beat 2 and 4 rows. For axpy tiles, AVX-512 blocks of up
// to 8 rows (x 3 vectors) beat 6 and 12 rows; AVX2's 4 rows (x 2) beat 3 and 6.
// Larger tiles made GCC spill.
struct TileShapes {
  int width;  // floats per vector
  int dot_registers, dot_max_rows;
  int axpy_registers, axpy_max_rows;  // the pairs tiles' too
};
constexpr TileShapes kAvx512Tiles{16, 30, 4, 30, 8};
constexpr TileShapes kAvx2Tiles{8, 15, 3, 15, 4};
constexpr TileShapes kBaselineTiles{4, 15, 3, 15, 4};

// Weight rows per dot tile of `rows` activation rows: as many as fit the
// accumulators (features * rows) and one vector of each operand in `registers`.
constexpr int dot_features_for(int registers, int rows) { return std::clamp((registers - rows) / (rows + 1), 1, 8); }

// Column vectors per axpy tile of `rows` activation rows: the accumulators
// (rows * vectors), the weight vectors and one broadcast fit in `registers`.
constexpr int axpy_vectors_for(int registers, int rows) { return std::clamp((registers - 1) / (rows + 1), 1, 8); }

// The largest of the balanced row blocks `rows` is cut into.
constexpr int largest_row_block(int rows, int max_rows) {
  const int blocks = (rows + max_rows - 1) / max_rows;
  return (rows + blocks - 1) / blocks;
}

// ---- [out, in]: dot tiles ------------------------------------------------------

struct DotProblem {
  float* out;
  const float* x;
  const float* weight;
  const float* bias;
  int rows, in, out_features;
  int chunk_features;  // output features per chunk of the pool
};

// Where the prefetches of the next tile's weight rows (contiguous) have got
// to: `step` bytes further each inner iteration, `lines` cache lines at a
// time, so that over all row blocks of a tile the cursor covers exactly the
// next tile, at the pace the current one is consumed.
struct Prefetcher {
  const char* cursor;
  long step;
  int lines;
};

// out[r, f] = bias[f] + Σ_i x[r, i] weight[f, i] for Features weight rows from
// `feature` and Rows activation rows from `row`. With Prefetch (a tile that
// has a successor) the next tile is requested into L2 while this one is used,
// so memory stays busy while the later row blocks compute on this tile from
// L1: without it a cold product cost the memory time plus the compute time
// instead of about the larger of the two (384 x 8192 at 16 rows, one core:
// 2.7 -> 1.5-1.7 ms; docs/PERF.md).

// sums[f][r] += w[f] * x[r, i..i+W) for one vector step at `i`, after
// requesting the next stretch of the following tile (Prefetch).
template <int W, int Features, int Rows, bool Prefetch, class V>
[[gnu::always_inline]] inline void dot_step(V (&sums)[Features * Rows], const V (&w)[Features], const float* x, int in,
                                            int i, Prefetcher& prefetcher) {
  if constexpr (Prefetch) {
    for (int line = 0; line < prefetcher.lines; ++line) __builtin_prefetch(prefetcher.cursor + 64 * line, 0, 2);
    prefetcher.cursor += prefetcher.step;
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    const V activation = load<V>(x + long(r) * in + i);
#pragma GCC unroll 16
    for (int f = 0; f < Features; ++f) sums[f * Rows + r] += w[f] * activation;
  }
}

template <int W, int Features, int Rows, bool Prefetch = false>
[[gnu::always_inline]] inline void dot_tile(const DotProblem& p, int feature, int row, Prefetcher& prefetcher) {
  using V = typename Floats<W>::Vector;
  const int in = p.in, vector_end = in - in % W;
  const float* x = p.x + long(row) * in;
  const float* weight = p.weight + long(feature) * in;
  V sums[Features * Rows];  // [feature][row]
#pragma GCC unroll 64
  for (int k = 0; k < Features * Rows; ++k) sums[k] = V{};
  for (int i = 0; i < vector_end; i += W) {
    V w[Features];
#pragma GCC unroll 16
    for (int f = 0; f < Features; ++f) w[f] = load<V>(weight + long(f) * in + i);
    dot_step<W, Features, Rows, Prefetch>(sums, w, x, in, i, prefetcher);
  }
  float totals[Features * Rows];
  sum_lanes<W, 0>(sums, totals);
  for (int f = 0; f < Features; ++f)
    for (int r = 0; r < Rows; ++r) {
      float sum = totals[f * Rows + r];
      for (int i = vector_end; i < in; ++i) sum += x[long(r) * in + i] * weight[long(f) * in + i];
      if (p.bias) sum += p.bias[feature + f];
      p.out[long(row + r) * p.out_features + feature + f] = sum;
    }
}

// Weight rows [begin, end) against all activation rows, in row blocks of Rows
// or Rows - 1 (balanced); each weight tile is reused across the row blocks
// while it is in L1.
template <int W, int Registers, int Rows>
[[gnu::always_inline]] inline void dot_features(const DotProblem& p, int begin, int end, int blocks) {
  constexpr int kFeatures = dot_features_for(Registers, Rows);
  constexpr int kFewer = Rows > 1 ? Rows - 1 : 1;
  // The next tile's kFeatures * in weights, spread over blocks * (in / W) iterations.
  const long step = std::max(1L, long(kFeatures) * W * long(sizeof(float)) / blocks);
  Prefetcher prefetcher{nullptr, step, int((step + 63) / 64)};
  int feature = begin;
  for (; feature + kFeatures <= end; feature += kFeatures) {
    const bool next = feature + 2 * kFeatures <= end;  // a next tile to prefetch
    prefetcher.cursor = reinterpret_cast<const char*>(p.weight + long(feature + kFeatures) * p.in);
    for (int block = 0, row = 0; block < blocks; ++block) {
      const int count = (p.rows - row) / (blocks - block) + ((p.rows - row) % (blocks - block) != 0);
      if (next) {
        if (count == Rows)
          dot_tile<W, kFeatures, Rows, true>(p, feature, row, prefetcher);
        else
          dot_tile<W, kFeatures, kFewer, true>(p, feature, row, prefetcher);
      } else {
        if (count == Rows)
          dot_tile<W, kFeatures, Rows>(p, feature, row, prefetcher);
        else
          dot_tile<W, kFeatures, kFewer>(p, feature, row, prefetcher);
      }
      row += count;
    }
  }
  for (; feature < end; ++feature)
    for (int block = 0, row = 0; block < blocks; ++block) {
      const int count = (p.rows - row) / (blocks - block) + ((p.rows - row) % (blocks - block) != 0);
      if (count == Rows)
        dot_tile<W, 1, Rows>(p, feature, row, prefetcher);
      else
        dot_tile<W, 1, kFewer>(p, feature, row, prefetcher);
      row += count;
    }
}

// Picks the row block for `largest` (the biggest of the balanced blocks).
template <int W, int Registers, int Rows>
[[gnu::always_inline]] inline void dot_rows(const DotProblem& p, int begin, int end, int blocks, int largest) {
  if constexpr (Rows > 1)
    if (largest < Rows) return dot_rows<W, Registers, Rows - 1>(p, begin, end, blocks, largest);
  dot_features<W, Registers, Rows>(p, begin, end, blocks);
}

// One chunk of output features. Registers: the instruction set's vector
// registers, less one or two for the compiler; MaxRows: the row block.
template <int W, int Registers, int MaxRows>
[[gnu::always_inline]] inline void dot_chunk(const DotProblem& p, int chunk) {
  const int begin = chunk * p.chunk_features, end = std::min(p.out_features, begin + p.chunk_features);
  const int blocks = (p.rows + MaxRows - 1) / MaxRows, largest = largest_row_block(p.rows, MaxRows);
  dot_rows<W, Registers, MaxRows>(p, begin, end, blocks, largest);
}

template <const TileShapes& Tiles>
[[gnu::always_inline]] inline void dot_chunk(const void* problem, int chunk) {
  dot_chunk<Tiles.width, Tiles.dot_registers, Tiles.dot_max_rows>(*static_cast<const DotProblem*>(problem), chunk);
}
__attribute__((target("arch=x86-64-v4"))) void dot_chunk_avx512(const void* problem, int chunk) {
  dot_chunk<kAvx512Tiles>(problem, chunk);
}
__attribute__((target("arch=x86-64-v3"))) void dot_chunk_avx2(const void* problem, int chunk) {
  dot_chunk<kAvx2Tiles>(problem, chunk);
}
void dot_chunk_baseline(const void* problem, int chunk) { dot_chunk<kBaselineTiles>(problem, chunk); }

// ---- [in, out]: axpy tiles -----------------------------------------------------

struct AxpyProblem {
  float* out;
  const float* x;
  const float* weight;
  int rows, in, out_features;
  int chunk_columns;  // output columns per chunk of the pool
};

// How many weight rows ahead axpy_tile requests its panel's stretch (Rows >=
// 4): a cold panel is `in` separate stretches of Vectors * W columns, one per
// weight row, and at 7-8 activation rows the hardware prefetcher left the
// tile waiting on memory. Measured cold (`dspark_matmul_benchmark --cold`,
// 8 rows, medians, on the bf16 weights this tile read before the pairs tile
// took them): 256 x 512 50 -> 23 us, 256 x 384 40 -> 18, 1536 x 256 99 ->
// 67; hot unchanged. At 1-2 rows it made small products slower
// (256 x 256: 6.5 -> 8 us), so it is off there. (Prefetching the next column
// panel instead, as dot_tile does the next tile, measured no faster.)
constexpr int kAxpyPrefetchRows = 12;

// out[r, c] = Σ_i x[r, i] weight[i, c] for Vectors * W columns from `column`
// and Rows activation rows from `row`.
template <int W, int Vectors, int Rows>
[[gnu::always_inline]] inline void axpy_tile(const AxpyProblem& p, int column, int row) {
  using V = typename Floats<W>::Vector;
  const int in = p.in;
  const long stride = p.out_features;
  const float* x = p.x + long(row) * in;
  const float* weight = p.weight + column;
  V sums[Rows][Vectors];
#pragma GCC unroll 64
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 64
    for (int v = 0; v < Vectors; ++v) sums[r][v] = V{};
  constexpr int kLines = int(Vectors * W * sizeof(float) + 63) / 64 + 1;  // + 1: the stretch may straddle a line
  for (int i = 0; i < in; ++i) {
    if constexpr (Rows >= 4)
      if (i + kAxpyPrefetchRows < in) {
        const char* ahead = reinterpret_cast<const char*>(weight + (i + kAxpyPrefetchRows) * stride);
#pragma GCC unroll 8
        for (int line = 0; line < kLines; ++line) __builtin_prefetch(ahead + 64 * line, 0, 3);
      }
    V w[Vectors];
#pragma GCC unroll 16
    for (int v = 0; v < Vectors; ++v) w[v] = load<V>(weight + i * stride + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const float activation = x[long(r) * in + i];
#pragma GCC unroll 16
      for (int v = 0; v < Vectors; ++v) sums[r][v] += w[v] * activation;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < Vectors; ++v) store(p.out + long(row + r) * stride + column + v * W, sums[r][v]);
}

// Fewer than W columns: scalar.
template <int Rows>
[[gnu::always_inline]] inline void axpy_scalar_column(const AxpyProblem& p, int column, int row) {
  float sums[Rows] = {};
  for (int i = 0; i < p.in; ++i) {
    const float w = p.weight[long(i) * p.out_features + column];
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) sums[r] += p.x[long(row + r) * p.in + i] * w;
  }
  for (int r = 0; r < Rows; ++r) p.out[long(row + r) * p.out_features + column] = sums[r];
}

template <int W, int Vectors, int Rows, int Fewer>
[[gnu::always_inline]] inline void axpy_column_tile(const AxpyProblem& p, int column, int blocks) {
  for (int block = 0, row = 0; block < blocks; ++block) {
    const int count = (p.rows - row) / (blocks - block) + ((p.rows - row) % (blocks - block) != 0);
    if constexpr (Vectors == 0) {
      if (count == Rows)
        axpy_scalar_column<Rows>(p, column, row);
      else
        axpy_scalar_column<Fewer>(p, column, row);
    } else {
      if (count == Rows)
        axpy_tile<W, Vectors, Rows>(p, column, row);
      else
        axpy_tile<W, Vectors, Fewer>(p, column, row);
    }
    row += count;
  }
}

// Columns [begin, end) against all activation rows in balanced row blocks of
// Rows or Rows - 1; each column panel of the weight is reused across the row
// blocks while it is in L1/L2.
template <int W, int Registers, int Rows>
[[gnu::always_inline]] inline void axpy_columns(const AxpyProblem& p, int begin, int end, int blocks) {
  constexpr int kVectors = axpy_vectors_for(Registers, Rows);
  constexpr int kFewer = Rows > 1 ? Rows - 1 : 1;
  int column = begin;
  for (; column + kVectors * W <= end; column += kVectors * W)
    axpy_column_tile<W, kVectors, Rows, kFewer>(p, column, blocks);
  for (; column + W <= end; column += W) axpy_column_tile<W, 1, Rows, kFewer>(p, column, blocks);
  for (; column < end; ++column) axpy_column_tile<W, 0, Rows, kFewer>(p, column, blocks);
}

template <int W, int Registers, int Rows>
[[gnu::always_inline]] inline void axpy_rows(const AxpyProblem& p, int begin, int end, int blocks, int largest) {
  if constexpr (Rows > 1)
    if (largest < Rows) return axpy_rows<W, Registers, Rows - 1>(p, begin, end, blocks, largest);
  axpy_columns<W, Registers, Rows>(p, begin, end, blocks);
}

template <int W, int Registers, int MaxRows>
[[gnu::always_inline]] inline void axpy_chunk(const AxpyProblem& p, int chunk) {
  const int begin = chunk * p.chunk_columns, end = std::min(p.out_features, begin + p.chunk_columns);
  const int blocks = (p.rows + MaxRows - 1) / MaxRows, largest = largest_row_block(p.rows, MaxRows);
  axpy_rows<W, Registers, MaxRows>(p, begin, end, blocks, largest);
}

template <const TileShapes& Tiles>
[[gnu::always_inline]] inline void axpy_chunk(const void* problem, int chunk) {
  axpy_chunk<Tiles.width, Tiles.axpy_registers, Tiles.axpy_max_rows>(*static_cast<const AxpyProblem*>(problem), chunk);
}
__attribute__((target("arch=x86-64-v4"))) void axpy_chunk_avx512(const void* problem, int chunk) {
  axpy_chunk<kAvx512Tiles>(problem, chunk);
}
__attribute__((target("arch=x86-64-v3"))) void axpy_chunk_avx2(const void* problem, int chunk) {
  axpy_chunk<kAvx2Tiles>(problem, chunk);
}
void axpy_chunk_baseline(const void* problem, int chunk) { axpy_chunk<kBaselineTiles>(problem, chunk); }

// ---- [out, in] bf16: pairs tiles ------------------------------------------------

// pack_bf16_rows' layout: output features in panels of kPanelFeatures; in a
// panel, for each pair of inputs (2k, 2k + 1), one 32-bit word per feature
// holding input 2k's weight in its high half and 2k + 1's in its low half
// (zero past the last input or feature). A panel is one AVX-512 vector of
// words per pair, so every vector of a tile streams its own panel front to
// back, 64 bytes a pair (from 3 rows on, requested ahead: prefetch_ahead
// below). Panels of 32 features, split between
// tiles of 3 or 5 vectors, were 10-20% slower cold. For the AVX-512 BF16
// tile the activations, rounded to bf16, are paired into the same words, a
// row of pairs per activation row.
constexpr int kPanelFeatures = 16;

struct PairsProblem {
  float* out;
  const float* x;           // [rows, in] activations (the widening tiles)
  const uint32_t* x_pairs;  // [rows, pairs] activations rounded to bf16, paired (the AVX-512 BF16 tile)
  const uint32_t* weight;   // the panels
  const float* bias;
  int rows, in, pairs, out_features;
  int chunk_features;  // output features per chunk of the pool
};

// Weight vectors per pairs tile of `rows` rows. AVX-512 BF16 (Dot): the
// accumulators, the weight vectors and one broadcast pair; widening: each
// weight vector is two float vectors (its words' high and low halves) and
// the pair two broadcasts.
constexpr int pairs_vectors_for(int registers, int rows, bool dot) {
  return std::clamp(dot ? (registers - 1) / (rows + 1) : (registers - 2) / (rows + 2), 1, 8);
}

template <class V, class U>
[[gnu::always_inline]] inline V as_floats(U words) {
  V value;
  std::memcpy(&value, &words, sizeof value);
  return value;
}

// sums[r][v] += the weights of inputs 2k and (WithLow) 2k + 1 times those
// activations, in that order: the high and the low halves of the words.
template <int W, int Vectors, int Rows, bool WithLow, class V>
[[gnu::always_inline]] inline void widening_pair_step(V (&sums)[Rows][Vectors],
                                                      const uint32_t* const (&streams)[Vectors], const PairsProblem& p,
                                                      int row, long k) {
  using U = typename Words<W>::Vector;
  V high[Vectors], low[Vectors];
#pragma GCC unroll 16
  for (int v = 0; v < Vectors; ++v) {
    U words;
    std::memcpy(&words, streams[v] + k * kPanelFeatures, sizeof words);
    high[v] = as_floats<V>(words & 0xffff0000u);
    low[v] = as_floats<V>(words << 16);
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    const float* x = p.x + long(row + r) * p.in + 2 * k;
#pragma GCC unroll 16
    for (int v = 0; v < Vectors; ++v) sums[r][v] += high[v] * x[0];
    if constexpr (WithLow)
#pragma GCC unroll 16
      for (int v = 0; v < Vectors; ++v) sums[r][v] += low[v] * x[1];
  }
}

// From 3 rows on, each step requests its streams' words kPrefetchPairs
// pairs ahead: the hardware prefetcher alone left a cold product costing
// about its memory time plus its compute time. Target forward at 3-8 rows
// 7-16% faster; at 1 row 7% slower, at 2 the same (docs/PERF.md, stop 18).
constexpr long kPrefetchPairs = 8;
template <int Vectors, int Rows>
[[gnu::always_inline]] inline void prefetch_ahead(const uint32_t* const (&streams)[Vectors], long k) {
  if constexpr (Rows >= 3)
#pragma GCC unroll 16
    for (int v = 0; v < Vectors; ++v) __builtin_prefetch(streams[v] + (k + kPrefetchPairs) * kPanelFeatures, 0, 3);
}

// out[r, f] = bias[f] + Σ_i x[r, i] weight[f, i], the sum taken in the order
// of i, for Vectors * W features from `feature` and Rows rows from `row`.
// Widening: an FMA per input (a multiply and an add on the baseline). Dot:
// vdpbf16ps on bf16 activations, which adds the high halves' product, then
// the low halves', each product of two bf16 exact in f32: the widening
// tile's bits on the same rounded activations.
template <int W, int Vectors, int Rows, bool Dot>
[[gnu::always_inline]] inline void pairs_tile(const PairsProblem& p, int feature, int row) {
  using V = typename Floats<W>::Vector;
  using U = typename Words<W>::Vector;
  const long panel_words = long(p.pairs) * kPanelFeatures;
  const uint32_t* streams[Vectors];  // vector v's words for pair 0, then every kPanelFeatures words
#pragma GCC unroll 16
  for (int v = 0; v < Vectors; ++v) {
    const int f = feature + v * W;
    streams[v] = p.weight + f / kPanelFeatures * panel_words + f % kPanelFeatures;
  }
  V sums[Rows][Vectors];
#pragma GCC unroll 64
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 64
    for (int v = 0; v < Vectors; ++v) sums[r][v] = V{};
  if constexpr (Dot) {
    static_assert(W == 16);
    typedef short Bf16Pairs __attribute__((vector_size(64)));  // __m512bh
    const uint32_t* x = p.x_pairs + long(row) * p.pairs;
    for (long k = 0; k < p.pairs; ++k) {
      prefetch_ahead<Vectors, Rows>(streams, k);
      Bf16Pairs w[Vectors];
#pragma GCC unroll 16
      for (int v = 0; v < Vectors; ++v) std::memcpy(&w[v], streams[v] + k * kPanelFeatures, sizeof w[v]);
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const U pair = U{} + x[r * p.pairs + k];
        Bf16Pairs activation;
        std::memcpy(&activation, &pair, sizeof activation);
#pragma GCC unroll 16
        for (int v = 0; v < Vectors; ++v) sums[r][v] = __builtin_ia32_dpbf16ps_v16sf(sums[r][v], activation, w[v]);
      }
    }
  } else {
    const long whole_pairs = p.in / 2;
    for (long k = 0; k < whole_pairs; ++k) {
      prefetch_ahead<Vectors, Rows>(streams, k);
      widening_pair_step<W, Vectors, Rows, true>(sums, streams, p, row, k);
    }
    if (whole_pairs < p.pairs) widening_pair_step<W, Vectors, Rows, false>(sums, streams, p, row, whole_pairs);
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < Vectors; ++v) {
      const int f = feature + v * W;
      float* out = p.out + long(row + r) * p.out_features + f;
      V sum = sums[r][v];
      if (f + W <= p.out_features) {
        if (p.bias) sum += load<V>(p.bias + f);
        store(out, sum);
      } else {  // the last features: the rest of the vector is the panel's padding
        for (int j = 0; f + j < p.out_features; ++j) out[j] = p.bias ? sum[j] + p.bias[f + j] : sum[j];
      }
    }
}

// Vectors * W features from `feature` against all rows, in balanced row
// blocks of Rows or Rows - 1; the later blocks reread the tile's panels from
// L1/L2.
template <int W, int Vectors, int Rows, bool Dot>
[[gnu::always_inline]] inline void pairs_column_tile(const PairsProblem& p, int feature, int blocks) {
  for (int block = 0, row = 0; block < blocks; ++block) {
    const int count = (p.rows - row) / (blocks - block) + ((p.rows - row) % (blocks - block) != 0);
    if (count == Rows)
      pairs_tile<W, Vectors, Rows, Dot>(p, feature, row);
    else
      pairs_tile<W, Vectors, (Rows > 1 ? Rows - 1 : 1), Dot>(p, feature, row);
    row += count;
  }
}

// Features [begin, end): multiples of W, but for `end` at out_features.
template <int W, int Registers, int Rows, bool Dot>
[[gnu::always_inline]] inline void pairs_features(const PairsProblem& p, int begin, int end, int blocks) {
  constexpr int kVectors = pairs_vectors_for(Registers, Rows, Dot);
  int feature = begin;
  for (; feature + kVectors * W <= end; feature += kVectors * W)
    pairs_column_tile<W, kVectors, Rows, Dot>(p, feature, blocks);
  for (; feature < end; feature += W) pairs_column_tile<W, 1, Rows, Dot>(p, feature, blocks);
}

template <int W, int Registers, int Rows, bool Dot>
[[gnu::always_inline]] inline void pairs_rows(const PairsProblem& p, int begin, int end, int blocks, int largest) {
  if constexpr (Rows > 1)
    if (largest < Rows) return pairs_rows<W, Registers, Rows - 1, Dot>(p, begin, end, blocks, largest);
  pairs_features<W, Registers, Rows, Dot>(p, begin, end, blocks);
}

template <const TileShapes& Tiles, bool Dot = false>
[[gnu::always_inline]] inline void pairs_chunk(const void* problem, int chunk) {
  const PairsProblem& p = *static_cast<const PairsProblem*>(problem);
  const int begin = chunk * p.chunk_features, end = std::min(p.out_features, begin + p.chunk_features);
  const int blocks = (p.rows + Tiles.axpy_max_rows - 1) / Tiles.axpy_max_rows;
  pairs_rows<Tiles.width, Tiles.axpy_registers, Tiles.axpy_max_rows, Dot>(
      p, begin, end, blocks, largest_row_block(p.rows, Tiles.axpy_max_rows));
}
__attribute__((target("arch=x86-64-v4,avx512bf16"))) void pairs_chunk_avx512_bf16(const void* problem, int chunk) {
  pairs_chunk<kAvx512Tiles, true>(problem, chunk);
}

// ---- AMX: bf16 products of bf16 weights, `in` a multiple of 32 ---------------------
//
// TDPBF16PS multiplies a tile of up to 16 activation rows x 16 input pairs
// (the rows of x_pairs) by 16 pairs x 16 features (16 consecutive rows of a
// panel, which is that tile's layout already) into 16 x 16 f32 sums. Both
// operands pair their inputs the same way (input 2k in a word's high half),
// and the instruction multiplies high by high and low by low, so the panels
// serve as they are. Its sums over a tile's 32 inputs are not taken in input
// order, so its bits differ from the other kernels' in the last places; each
// output still depends on its own row only, so a row has the same bits at
// every row count. It costs the same for 1 row as for 16: a verify block
// costs what one decode row does (both are bound by reading the weights).
struct AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
constexpr int kAmxPanels = 4;  // sum tiles 0-3: four panels (64 features) per pass; 4: activations; 5-7: weights
constexpr int kAmxGranule = kAmxPanels * kPanelFeatures;

__attribute__((target("arch=x86-64-v4,avx512bf16,amx-tile,amx-bf16"))) void configure_amx(int rows) {
  AmxTileConfig config;
  for (int tile = 0; tile <= 4; ++tile) config.rows[tile] = uint8_t(rows), config.bytes_per_row[tile] = 64;
  for (int tile = 5; tile < 8; ++tile) config.rows[tile] = 16, config.bytes_per_row[tile] = 64;
  // GCC 12 does not see the instruction read `config`: without this its stores may be dropped.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

__attribute__((target("arch=x86-64-v4,avx512bf16,amx-tile,amx-bf16"))) void pairs_chunk_amx(const void* problem,
                                                                                            int chunk) {
  const PairsProblem& p = *static_cast<const PairsProblem*>(problem);
  const int begin = chunk * p.chunk_features, end = std::min(p.out_features, begin + p.chunk_features);
  const int last_panel = (end + kPanelFeatures - 1) / kPanelFeatures;
  const long panel_words = long(p.pairs) * kPanelFeatures;
  alignas(64) float sums[16][kAmxGranule];
  int configured = 0;
  for (int row = 0; row < p.rows; row += 16) {
    const int rows = std::min(16, p.rows - row);
    if (rows != configured) configure_amx(configured = rows);
    const uint32_t* x = p.x_pairs + long(row) * p.pairs;
    for (int panel = begin / kPanelFeatures; panel < last_panel; panel += kAmxPanels) {
      const int panels = std::min(kAmxPanels, last_panel - panel);
      const uint32_t* w = p.weight + panel * panel_words;
      // (The tile intrinsics are statements: one per line.)
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (long k = 0; k < p.pairs; k += 16, w += 16 * kPanelFeatures) {
        _tile_loadd(4, x + k, p.pairs * 4);
        _tile_loadd(5, w, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (panels > 1) {
          _tile_loadd(6, w + panel_words, 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (panels > 2) {
          _tile_loadd(7, w + 2 * panel_words, 64);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (panels > 3) {
          _tile_loadd(5, w + 3 * panel_words, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, &sums[0][0], sizeof sums[0]);
      if (panels > 1) _tile_stored(1, &sums[0][16], sizeof sums[0]);
      if (panels > 2) _tile_stored(2, &sums[0][32], sizeof sums[0]);
      if (panels > 3) _tile_stored(3, &sums[0][48], sizeof sums[0]);
      const int first = panel * kPanelFeatures, count = std::min(end, first + panels * kPanelFeatures) - first;
      for (int r = 0; r < rows; ++r) {
        float* out = p.out + long(row + r) * p.out_features + first;
        for (int j = 0; j < count; ++j) out[j] = p.bias ? sums[r][j] + p.bias[first + j] : sums[r][j];
      }
    }
  }
  _tile_release();
}
__attribute__((target("arch=x86-64-v4"))) void pairs_chunk_avx512(const void* problem, int chunk) {
  pairs_chunk<kAvx512Tiles>(problem, chunk);
}
__attribute__((target("arch=x86-64-v3"))) void pairs_chunk_avx2(const void* problem, int chunk) {
  pairs_chunk<kAvx2Tiles>(problem, chunk);
}
void pairs_chunk_baseline(const void* problem, int chunk) { pairs_chunk<kBaselineTiles>(problem, chunk); }

// ---- dispatch ---------------------------------------------------------------------

// AMX's tile registers are state Linux hands a process only on request.
bool amx_permitted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

MatmulIsa widest_supported() {
  __builtin_cpu_init();
  static const bool amx = __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted();
  if (amx) return MatmulIsa::Amx;
  if (__builtin_cpu_supports("x86-64-v4"))
    return __builtin_cpu_supports("avx512bf16") ? MatmulIsa::Avx512Bf16 : MatmulIsa::Avx512;
  if (__builtin_cpu_supports("x86-64-v3")) return MatmulIsa::Avx2;
  return MatmulIsa::Baseline;
}

std::atomic<MatmulIsa>& chosen_isa() {
  static std::atomic<MatmulIsa> chosen{widest_supported()};
  return chosen;
}

const TileShapes& tile_shapes(MatmulIsa isa) {
  return isa >= MatmulIsa::Avx512 ? kAvx512Tiles : isa == MatmulIsa::Avx2 ? kAvx2Tiles : kBaselineTiles;
}

// Output features per chunk: a whole number of tiles (`granule` features, so
// no chunk ends in narrow leftover tiles), several chunks per thread so a slow
// thread delays the product by at most one chunk, and none smaller than
// kMinChunkWork. One chunk (the caller alone) when the product is small.
int chunk_size(long work, int out_features, int granule) {
  const int threads = parallel_threads();
  const long most_chunks = std::min<long>({threads * 4L, work / kMinChunkWork, (out_features + granule - 1) / granule});
  if (threads == 1 || most_chunks < 2) return out_features;
  const int granules = (out_features + granule - 1) / granule;
  return int((granules + most_chunks - 1) / most_chunks) * granule;
}

// A product's activations rounded to bf16 (bf16_products), per calling
// thread (the pool's workers read the caller's): as f32 values, for the
// widening tiles, or in pairs, for the AVX-512 BF16 tile.
const float* rounded_to_bf16(const float* x, long count) {
  thread_local std::vector<float> rounded;
  if (rounded.size() < size_t(count)) rounded.resize(size_t(count));  // grown only: no refill per product
  for (long i = 0; i < count; ++i) rounded[size_t(i)] = bf16_to_f32(f32_to_bf16(x[i]));
  return rounded.data();
}
// f32_to_bf16 of 16 values at once (their bits in, the bf16 bits in the low halves out).
template <class U>
[[gnu::always_inline]] inline U rounded_bf16_bits(U bits) {
  const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, quiet_nan = (bits >> 16) | 0x40u;
  return (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

// Only the AVX-512 BF16 tile reads pairs, so this is built for that ISA
// alone, 16 pairs a step: the conversion is a serial part of every product
// (scalar, 5 rows x 1408 inputs took ~8 us, a quarter of the product).
__attribute__((target("arch=x86-64-v4"))) const uint32_t* bf16_pairs(const float* x, int rows, int in) {
  using U = Words<16>::Vector;
  thread_local std::vector<uint32_t> pairs;
  const int count = (in + 1) / 2, whole = in / 2;
  if (pairs.size() < size_t(rows) * count) pairs.resize(size_t(rows) * count);
  for (long row = 0; row < rows; ++row) {
    const float* source = x + row * in;
    uint32_t* destination = pairs.data() + row * count;
    int k = 0;
    for (; k + 16 <= whole; k += 16) {
      U first, second;  // inputs 2k .. 2k + 15, 2k + 16 .. 2k + 31
      std::memcpy(&first, source + 2 * k, sizeof first);
      std::memcpy(&second, source + 2 * k + 16, sizeof second);
      first = rounded_bf16_bits(first), second = rounded_bf16_bits(second);
      const U even = __builtin_shufflevector(first, second, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const U odd = __builtin_shufflevector(first, second, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
      const U words = even << 16 | odd;
      std::memcpy(destination + k, &words, sizeof words);
    }
    for (; k < whole; ++k) destination[k] = uint32_t(f32_to_bf16(source[2 * k])) << 16 | f32_to_bf16(source[2 * k + 1]);
    if (whole < count) destination[whole] = uint32_t(f32_to_bf16(source[2 * whole])) << 16;
  }
  return pairs.data();
}

}  // namespace

int matmul_threads() { return parallel_threads(); }

MatmulIsa matmul_isa() { return chosen_isa().load(std::memory_order_relaxed); }

namespace {
std::atomic<bool> bf16_products_on{false};
}  // namespace

void set_bf16_products(bool on) { bf16_products_on.store(on, std::memory_order_relaxed); }

bool bf16_products() { return bf16_products_on.load(std::memory_order_relaxed); }

bool matmul_isa_supported(MatmulIsa isa) { return int(isa) <= int(widest_supported()); }

void set_matmul_isa(MatmulIsa isa) {
  DSPARK_CHECK(matmul_isa_supported(isa), "this CPU lacks the instruction set ", matmul_isa_name(isa));
  chosen_isa().store(isa, std::memory_order_relaxed);
}

const char* matmul_isa_name(MatmulIsa isa) {
  switch (isa) {
    case MatmulIsa::Amx:
      return "amx";
    case MatmulIsa::Avx512Bf16:
      return "avx512-bf16";
    case MatmulIsa::Avx512:
      return "avx512";
    case MatmulIsa::Avx2:
      return "avx2";
    default:
      return "baseline";
  }
}

void matmul_forward_small_rows(float* out, const float* x, const float* weight, const float* bias, int rows,
                               int in_features, int out_features) {
  if (rows <= 0 || out_features <= 0) return;
  DotProblem problem{out, x, weight, bias, rows, in_features, out_features, 0};
  const TileShapes& tiles = tile_shapes(matmul_isa());
  const int tile_features = dot_features_for(tiles.dot_registers, largest_row_block(rows, tiles.dot_max_rows));
  problem.chunk_features = chunk_size(long(rows) * in_features * out_features, out_features, tile_features);
  const int chunks = (out_features + problem.chunk_features - 1) / problem.chunk_features;
  parallel_run(for_matmul_isa(dot_chunk_avx512, dot_chunk_avx2, dot_chunk_baseline), &problem, chunks);
}

namespace {

// The panels of a weight whose element (feature, input) is weight[feature *
// feature_stride + input * input_stride].
std::vector<uint16_t> pack_bf16_panels(const float* weight, int out_features, int in_features, long feature_stride,
                                       long input_stride) {
  const std::vector<uint16_t> bits = exact_bf16(weight, size_t(out_features) * in_features);
  if (bits.empty()) return bits;
  const long pairs = (in_features + 1) / 2, panels = (out_features + kPanelFeatures - 1) / kPanelFeatures;
  std::vector<uint16_t> packed(size_t(panels * pairs * kPanelFeatures * 2), 0);
  for (long feature = 0; feature < out_features; ++feature)
    for (long i = 0; i < in_features; ++i) {
      const long word = (feature / kPanelFeatures * pairs + i / 2) * kPanelFeatures + feature % kPanelFeatures;
      packed[size_t(2 * word + (i % 2 == 0))] = bits[size_t(feature * feature_stride + i * input_stride)];  // 2k: high
    }
  return packed;
}

}  // namespace

std::vector<uint16_t> pack_bf16_rows(const float* weight, int out_features, int in_features) {
  return pack_bf16_panels(weight, out_features, in_features, in_features, 1);
}

std::vector<uint16_t> pack_bf16_columns(const float* weight, int in_features, int out_features) {
  return pack_bf16_panels(weight, out_features, in_features, 1, out_features);
}

void matmul_forward_small_rows(float* out, const float* x, const uint16_t* weight, const float* bias, int rows,
                               int in_features, int out_features) {
  if (rows <= 0 || out_features <= 0) return;
  const MatmulIsa isa = matmul_isa();
  const bool rounded = bf16_products(), dot = rounded && isa >= MatmulIsa::Avx512Bf16;
  const bool amx = rounded && isa == MatmulIsa::Amx && in_features % 32 == 0;
  PairsProblem problem{out,          x,    nullptr,     reinterpret_cast<const uint32_t*>(weight),
                       bias,         rows, in_features, (in_features + 1) / 2,
                       out_features, 0};
  if (dot)
    problem.x_pairs = bf16_pairs(x, rows, in_features);
  else if (rounded)
    problem.x = rounded_to_bf16(x, long(rows) * in_features);
  if (amx) {  // a tile's work is that of 16 rows, however many it holds
    problem.chunk_features = chunk_size(long(16) * in_features * out_features, out_features, kAmxGranule);
    parallel_run(pairs_chunk_amx, &problem, (out_features + problem.chunk_features - 1) / problem.chunk_features);
    return;
  }
  const TileShapes& tiles = tile_shapes(isa);
  const int tile_features =
      tiles.width * pairs_vectors_for(tiles.axpy_registers, largest_row_block(rows, tiles.axpy_max_rows), dot);
  problem.chunk_features = chunk_size(long(rows) * in_features * out_features, out_features, tile_features);
  const int chunks = (out_features + problem.chunk_features - 1) / problem.chunk_features;
  parallel_run(
      dot ? pairs_chunk_avx512_bf16 : for_matmul_isa(pairs_chunk_avx512, pairs_chunk_avx2, pairs_chunk_baseline),
      &problem, chunks);
}

void matmul_in_out_forward_small_rows(float* out, const float* x, const float* weight, int rows, int in_features,
                                      int out_features) {
  if (rows <= 0 || out_features <= 0) return;
  AxpyProblem problem{out, x, weight, rows, in_features, out_features, 0};
  const TileShapes& tiles = tile_shapes(matmul_isa());
  const int tile_columns =
      tiles.width * axpy_vectors_for(tiles.axpy_registers, largest_row_block(rows, tiles.axpy_max_rows));
  problem.chunk_columns = chunk_size(long(rows) * in_features * out_features, out_features, tile_columns);
  const int chunks = (out_features + problem.chunk_columns - 1) / problem.chunk_columns;
  parallel_run(for_matmul_isa(axpy_chunk_avx512, axpy_chunk_avx2, axpy_chunk_baseline), &problem, chunks);
}

void matmul_forward_blas(float* out, const float* x, const float* weight, const float* bias, int rows, int in_features,
                         int out_features) {
  if (rows == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, out_features, in_features, 1.0f, weight, in_features, x, 1, 0.0f, out, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out_features, in_features, 1.0f, x, in_features, weight,
                in_features, 0.0f, out, out_features);
  }
  if (bias)
    for (int row = 0; row < rows; ++row)
      for (int column = 0; column < out_features; ++column)
        out[static_cast<long>(row) * out_features + column] += bias[column];
}

void matmul_in_out_forward_blas(float* out, const float* x, const float* weight, int rows, int in_features,
                                int out_features) {
  if (rows == 1) {
    cblas_sgemv(CblasRowMajor, CblasTrans, in_features, out_features, 1.0f, weight, out_features, x, 1, 0.0f, out, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, out_features, in_features, 1.0f, x, in_features,
                weight, out_features, 0.0f, out, out_features);
  }
}

void matmul_forward(float* out, const float* x, const float* weight, const float* bias, int rows, int in_features,
                    int out_features) {
  if (rows <= kSmallRowsMax)
    matmul_forward_small_rows(out, x, weight, bias, rows, in_features, out_features);
  else
    matmul_forward_blas(out, x, weight, bias, rows, in_features, out_features);
}

void matmul_forward(float* out, const float* x, const float* weight, const uint16_t* weight_bf16, const float* bias,
                    int rows, int in_features, int out_features) {
  if (weight_bf16)
    matmul_forward_small_rows(out, x, weight_bf16, bias, rows, in_features, out_features);
  else
    matmul_forward(out, x, weight, bias, rows, in_features, out_features);
}

void matmul_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                     int in_features, int out_features) {
  if (rows == 0) return;
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, in_features, out_features, 1.0f, dout, out_features,
                weight, in_features, 1.0f, dx, in_features);
  if (dweight)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out_features, in_features, rows, 1.0f, dout, out_features, x,
                in_features, 1.0f, dweight, in_features);
}

void matmul_in_out_forward(float* out, const float* x, const float* weight, int rows, int in_features,
                           int out_features) {
  if (rows <= kSmallRowsMax)
    matmul_in_out_forward_small_rows(out, x, weight, rows, in_features, out_features);
  else
    matmul_in_out_forward_blas(out, x, weight, rows, in_features, out_features);
}

void matmul_in_out_forward(float* out, const float* x, const float* weight, const uint16_t* weight_bf16, int rows,
                           int in_features, int out_features) {
  if (weight_bf16)
    matmul_forward_small_rows(out, x, weight_bf16, nullptr, rows, in_features, out_features);
  else
    matmul_in_out_forward(out, x, weight, rows, in_features, out_features);
}

void matmul_in_out_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                            int in_features, int out_features) {
  if (rows == 0) return;
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, in_features, out_features, 1.0f, dout, out_features,
                weight, out_features, 1.0f, dx, in_features);
  if (dweight)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in_features, out_features, rows, 1.0f, x, in_features, dout,
                out_features, 1.0f, dweight, out_features);
}

}  // namespace dspark::cpu
