// Helpers for the CPU kernels written with GCC vector extensions (matmul.cpp,
// attention.cpp). Each kernel is compiled once per instruction set (functions
// with __attribute__((target(...))) that inline these), so everything here is
// always_inline: a vector wider than the baseline ABI's registers never crosses
// a call.
//
// sum_lanes sums each accumulator's lanes with the same fixed tree (lane m +
// lane m + W/2, then m + W/4, ...) however many accumulators it is given and
// wherever in the array they sit: a kernel whose results must not depend on
// its tiling (attention: a token's output is the same in a 1-row decode step
// and inside a k-row verify) can rely on that.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

// These wide vectors never cross a call (everything here is inlined into the
// per-instruction-set entry points), so GCC's -Wpsabi remarks that passing or
// returning them would change the ABI do not apply; CMakeLists.txt turns them
// off (a pragma cannot: GCC reports them against this header after the
// includer's code instantiates it). Internal linkage: each kernel file keeps
// its own inlined copies.
namespace dspark::cpu::simd {
namespace {

template <int W>
struct Floats {
  typedef float Vector __attribute__((vector_size(W * sizeof(float))));
};
// (Vector types of a template-dependent size must be declared like this, in a
// class template: GCC ignores vector_size on a dependent local typedef.)
template <int W>
struct Ints {
  typedef int Vector __attribute__((vector_size(W * sizeof(int))));
};
template <int W>
struct Doubles {
  typedef double Vector __attribute__((vector_size(W * sizeof(double))));
};

template <class V>
[[gnu::always_inline]] inline V load(const float* source) {
  V value;
  std::memcpy(&value, source, sizeof value);
  return value;
}

// W 32-bit words (matmul.cpp's bf16 pairs: a word's high half is the f32 of
// one bf16 value, its low half shifted up the other's).
template <int W>
struct Words {
  typedef unsigned Vector __attribute__((vector_size(W * sizeof(unsigned))));
};

template <class V>
[[gnu::always_inline]] inline void store(float* destination, V value) {
  std::memcpy(destination, &value, sizeof value);
}

// Lane sums of many accumulators at once. combine(u, v) with G lanes per
// accumulator in u and v (each holding W / G accumulators) adds the two halves
// of every accumulator's lanes and packs the results, u's then v's, into one
// vector with G / 2 lanes per accumulator: two shuffles and one add for what
// takes a shuffle and an add per accumulator one at a time. A tree of them
// turns W accumulators into one vector of their W sums, in order.
template <int W, int G, int K, int Upper>
constexpr int combine_lane() {
  const int j = K < W / 2 ? K : K - W / 2, source = K < W / 2 ? 0 : W;
  return source + j / (G / 2) * G + Upper * (G / 2) + j % (G / 2);
}

template <int W, int G, class V, size_t... K>
[[gnu::always_inline]] inline V combine(V u, V v, std::index_sequence<K...>) {
  return __builtin_shufflevector(u, v, combine_lane<W, G, int(K), 0>()...) +
         __builtin_shufflevector(u, v, combine_lane<W, G, int(K), 1>()...);
}

// N (a power of two, <= W) accumulators from acc[First]: a vector holding N
// groups of W / N lanes, group k summing to accumulator k.
template <int W, int N, int First, class V, int Count>
[[gnu::always_inline]] inline V reduce_tree(const V (&acc)[Count]) {
  if constexpr (N == 1) {
    return acc[First];
  } else {
    return combine<W, 2 * W / N>(reduce_tree<W, N / 2, First>(acc), reduce_tree<W, N / 2, First + N / 2>(acc),
                                 std::make_index_sequence<W>());
  }
}

// sums[k] = the sum of acc[k]'s lanes, for acc[First .. Count).
template <int W, int First, class V, int Count>
[[gnu::always_inline]] inline void sum_lanes(const V (&acc)[Count], float* sums) {
  if constexpr (First < Count) {
    constexpr int kLeft = Count - First;
    constexpr int kGroup = kLeft >= W       ? W
                           : kLeft >= W / 2 ? W / 2
                           : kLeft >= W / 4 ? W / 4
                           : kLeft >= 8     ? 8
                           : kLeft >= 4     ? 4
                           : kLeft >= 2     ? 2
                                            : 1;
    V tree = reduce_tree<W, kGroup, First>(acc);
    // Fewer than W accumulators: keep halving each group within the vector.
    if constexpr (kGroup <= W / 2) tree = combine<W, W / kGroup>(tree, tree, std::make_index_sequence<W>());
    if constexpr (kGroup <= W / 4) tree = combine<W, W / kGroup / 2>(tree, tree, std::make_index_sequence<W>());
    if constexpr (kGroup <= W / 8) tree = combine<W, W / kGroup / 4>(tree, tree, std::make_index_sequence<W>());
    if constexpr (kGroup <= W / 16) tree = combine<W, W / kGroup / 8>(tree, tree, std::make_index_sequence<W>());
#pragma GCC unroll 16
    for (int k = 0; k < kGroup; ++k) sums[First + k] = tree[k];
    sum_lanes<W, First + kGroup>(acc, sums);
  }
}

// exp(x) lane by lane, Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a
// degree-7 polynomial in r, times 2^n built in the exponent bits (as two
// factors 2^(n/2) 2^(n - n/2), so n = 128 needs no special case); relative
// error ~2e-7. Below -87.3 (where 2^n would leave the normal range) it
// returns 0, above 88.72 infinity; NaN stays NaN. The same input gives the
// same bits in every lane and every call (for one instruction set), unlike
// a libm call whose result a vectorised loop's tail might compute another way.
template <int W, class V>
[[gnu::always_inline]] inline V exp(V x) {
  using Ints = typename simd::Ints<W>::Vector;
  const V lowest = V{} - 87.3f, highest = V{} + 88.72f;
  V clamped = x < lowest ? lowest : x;
  clamped = clamped > highest ? highest : clamped;
  // Round x / ln2 to the nearest integer (adding and subtracting 1.5 * 2^23).
  const V n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  V r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const Ints whole = __builtin_convertvector(n, Ints), half = whole >> 1;
  const Ints first = (half + 127) << 23, second = (whole - half + 127) << 23;
  const V result = y * (V)first * (V)second;  // a vector cast keeps the bits
  return x < lowest ? V{} : x > highest ? V{} + __builtin_inff() : result;
}

}  // namespace
}  // namespace dspark::cpu::simd
