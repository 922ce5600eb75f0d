// Helpers of the CUDA tests: random inputs, bf16 rounding, copies to and
// from the device, and greedy GPU output judged against the f32 CPU target.
#pragma once
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/random.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cuda/buffer.h"
#include "model/generate.h"
#include "model/target.h"

namespace dspark::testing {

constexpr double kBf16Tolerance = 1e-2;  // bf16 outputs of f32 math on bf16 inputs

inline std::vector<float> random_values(size_t count, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> values(count);
  for (float& value : values) value = scale * static_cast<float>(2.0 * rng.uniform() - 1.0);
  return values;
}

// Rounds to bf16 and back: the inputs both sides see.
inline std::vector<float> bf16_rounded(std::vector<float> values) {
  for (float& value : values) value = bf16_to_f32(f32_to_bf16(value));
  return values;
}

inline cuda::DeviceBuffer<__nv_bfloat16> to_device_bf16(const std::vector<float>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = f32_to_bf16(values[i]);
  cuda::DeviceBuffer<__nv_bfloat16> buffer(values.size());
  CUDA_CHECK(cudaMemcpy(buffer.data(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  return buffer;
}

template <class T>
cuda::DeviceBuffer<T> to_device(const std::vector<T>& values) {
  cuda::DeviceBuffer<T> buffer(values.size());
  CUDA_CHECK(cudaMemcpy(buffer.data(), values.data(), buffer.bytes(), cudaMemcpyHostToDevice));
  return buffer;
}

inline std::vector<float> from_device(const cuda::DeviceBuffer<__nv_bfloat16>& buffer) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> bits(buffer.size());
  CUDA_CHECK(cudaMemcpy(bits.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost));
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = bf16_to_f32(bits[i]);
  return values;
}

template <class T>
std::vector<T> from_device(const cuda::DeviceBuffer<T>& buffer) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<T> values(buffer.size());
  CUDA_CHECK(cudaMemcpy(values.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost));
  return values;
}

// ---------------------------------------------------------------- greedy output under bf16

// bf16 weights and activations move a GPU logit away from its f32 value by up
// to about this fraction of the row's logit spread (max - min): a greedy token
// whose f32 top-2 gap is smaller may come out either way, and two GPU runs
// that compute the same row through different kernels (a verify block vs a
// decode step, a prefill vs a verify: GEMV or cuBLASLt by row count) may pick
// differently. The bound GreedyTokensAreTheTargetsArgmax uses.
constexpr float kGreedyNoise = 2e-2f;

// The f32 CPU target's view of greedy `tokens` generated after `prompt`,
// teacher-forced on their own history (after a flipped near-tie no other run's
// path is a reference).
struct GreedyMargins {
  std::vector<bool> near_best;  // [n] the token's logit is within kGreedyNoise of the spread below the best
  std::vector<bool> clear;      // [n] the top-2 gap exceeds that: no bf16 argmax can differ from the CPU's
  // Leading tokens with a clear gap: every GPU greedy run from `prompt` that is
  // right up to bf16 noise reproduces exactly this prefix.
  size_t clear_prefix() const { return size_t(std::find(clear.begin(), clear.end(), false) - clear.begin()); }
};

inline GreedyMargins greedy_margins(Target& cpu, const std::vector<int32_t>& prompt,
                                    const std::vector<int32_t>& tokens) {
  GreedyMargins margins;
  if (tokens.empty()) return margins;
  std::vector<int32_t> history(prompt);
  history.insert(history.end(), tokens.begin(), tokens.end() - 1);  // row i predicts tokens[i]
  const int sequence = cpu.create_sequence(static_cast<int>(history.size()));
  TargetInput input{sequence, history, true};
  TargetRequest request;
  request.want_logits = true;
  TargetResult result;
  cpu.forward({&input, 1}, request, result);
  cpu.release_sequence(sequence);
  const int V = cpu.config().vocab_size;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const float* row = result.logits.data() + (prompt.size() - 1 + i) * V;
    const int32_t best = cpu::argmax(row, V);
    const float noise = kGreedyNoise * (row[best] - *std::min_element(row, row + V));
    float second = -INFINITY;
    for (int v = 0; v < V; ++v)
      if (v != best) second = std::max(second, row[v]);
    margins.near_best.push_back(row[tokens[i]] >= row[best] - noise);
    margins.clear.push_back(row[best] - second > noise);
  }
  return margins;
}

// A one-token prompt whose f32 greedy continuation of `count` tokens has a
// clear top-2 gap at every step (the first such token id), so that GPU runs
// from it must agree on every token exactly.
inline std::vector<int32_t> one_token_prompt_with_clear_greedy(Target& cpu, int count) {
  GenerateOptions options;
  options.max_new_tokens = count;
  options.ignore_eos = true;
  for (int32_t token = 0; token < cpu.config().vocab_size; ++token) {
    const std::vector<int32_t> prompt = {token};
    if (greedy_margins(cpu, prompt, generate(cpu, prompt, options).tokens).clear_prefix() == size_t(count))
      return prompt;
  }
  fail("no one-token prompt has a clear greedy continuation of ", count, " tokens");
}

// Greedy speculative decoding on a bf16 GPU target is lossless when every
// token it emits is the target's argmax up to bf16 noise (judged by the f32
// CPU target on the speculative run's own history), and it agrees with plain
// GPU decoding exactly on each prompt's clear prefix (the plain output's
// GreedyMargins::clear_prefix: past a near-tie the two runs may part, each
// still right). Plain's tokens are held to the same bound. Returns how many
// tokens were compared exactly.
template <class Plain, class Speculative>
size_t expect_greedy_equals_plain(Target& cpu, const std::vector<std::vector<int32_t>>& prompts,
                                  const std::vector<Plain>& plain, const std::vector<Speculative>& spec,
                                  const std::string& what) {
  size_t exact = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string where = what + " prompt " + std::to_string(i);
    EXPECT_EQ(spec[i].tokens.size(), plain[i].tokens.size()) << where;
    const GreedyMargins plain_margins = greedy_margins(cpu, prompts[i], plain[i].tokens);
    const GreedyMargins spec_margins = greedy_margins(cpu, prompts[i], spec[i].tokens);
    for (const auto* margins : {&plain_margins, &spec_margins}) {
      const auto far = std::find(margins->near_best.begin(), margins->near_best.end(), false);
      EXPECT_TRUE(far == margins->near_best.end())
          << where << (margins == &plain_margins ? " plain" : " speculative") << " token "
          << (far - margins->near_best.begin()) << " is not the target's argmax, even allowing for bf16 noise";
    }
    const size_t clear = std::min(plain_margins.clear_prefix(), spec[i].tokens.size());
    EXPECT_TRUE(std::equal(spec[i].tokens.begin(), spec[i].tokens.begin() + clear, plain[i].tokens.begin()))
        << where << ": the first " << clear << " tokens have clear top-2 gaps, yet speculative "
        << ::testing::PrintToString(spec[i].tokens) << " differs from plain "
        << ::testing::PrintToString(plain[i].tokens);
    exact += clear;
  }
  return exact;
}

}  // namespace dspark::testing
