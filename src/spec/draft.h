// Drafting with a DSpark drafter on the CPU (DESIGN.md §2, the seed's
// forwardRows): the parallel backbone runs once for every row of a batch,
// then the cheap sequential head walks the block position by position,
// picking each token (argmax, or a sample from the processed distribution
// with the row's own seeded stream) and feeding it to the next position.
// Pruning stops a row at the first position k >= 1 whose confidence falls
// below its threshold; position 0 is always kept.
//
// Calibration (config.sts, fitted by `dspark calibrate`, train/calibrate.h):
// every confidence the drafter reports is the calibrated one, its logit
// divided by the position's STS temperature, and the per-position thresholds
// are compared with that calibrated value (they were fitted on it).
#pragma once
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "core/random.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/sampling.h"
#include "model/transformer.h"
#include "spec/drafter.h"

namespace dspark {

// The target's pieces the drafter reads in place (never copied into it).
struct TargetHead {
  const float* embedding = nullptr;        // [V, H] the raw input embedding (no scaling)
  const float* lm_head = nullptr;          // [V, H] the output head; the embedding itself when tied
  const uint16_t* lm_head_bf16 = nullptr;  // [V, H] its bf16 bits (cpu::pack_bf16_rows) when exactly bf16, or null
};

TargetHead target_head_of(const Transformer& model);

// The embedding and LM head read from a target checkpoint on their own (for a
// target whose weights live elsewhere, e.g. on the GPU).
struct TargetHeadWeights {
  Tensor embedding;                    // [V, H]
  Tensor lm_head;                      // [V, H]
  std::vector<uint16_t> lm_head_bf16;  // [V, H] or empty, as Transformer::lm_head_bf16
  TargetHead view() const { return {embedding.data, lm_head.data, cpu::bf16_or_null(lm_head_bf16)}; }
};

TargetHeadWeights load_target_head(const std::filesystem::path& target_directory, const ModelConfig& config);

// One request's retained context: per drafter layer, the keys and values of
// rms(Hc, attn_norm) for every context row seen so far. Each round projects
// only the new rows (the norm is per row, so this equals recomputing all).
struct DraftContext {
  int length = 0;
  std::vector<std::vector<float>> keys, values;  // [layer][length * d]
  void truncate(int new_length);
};

// Appends `count` context rows, each the m tapped target rows of one token
// concatenated on features: tapped_rows [count, m * H].
void extend_draft_context(const Drafter& drafter, DraftContext& context, const float* tapped_rows, int count);
// The same for several contexts in one pass: context i gets counts[i] rows
// from tapped_rows[i] [counts[i], m * H]. Each row's keys and values are the
// bits extend_draft_context gives it alone. Scratch comes from `work` (a
// draft source's own, so a round allocates nothing).
struct DraftWorkspace;
void extend_draft_contexts(const Drafter& drafter, std::span<DraftContext* const> contexts,
                           std::span<const float* const> tapped_rows, std::span<const int> counts,
                           DraftWorkspace& work);

struct DraftOptions {
  cpu::SamplingParams sampling;       // greedy at temperature 0
  std::vector<float> thresholds;      // [γ] per-position confidence thresholds; empty: config.sts's, if any
  bool calibrated_thresholds = true;  // prune by config.sts thresholds when `thresholds` is empty
  float min_confidence = 0.0f;        // a uniform threshold; 0: none
  int max_tokens = 0;                 // draft at most this many (<= γ); 0: γ
  bool collect_logits = false;        // return each drafted position's logits
};

struct DraftRequest {
  const DraftContext* context;
  int32_t anchor;  // the last token the target has accepted (its row is not in the context yet)
  Rng* rng;        // this row's stream, drawn from only when sampling
};

struct DraftResult {
  std::vector<int32_t> tokens;    // n >= 1 drafted tokens
  std::vector<float> confidence;  // [n] c_k
  std::vector<float> logits;      // [n, V] L_k, when collected
  std::vector<float> probs;       // [n, V] the processed distributions the tokens were drawn from, when
                                  // sampling (empty at temperature 0)
};

// Activations reused across calls.
struct DraftWorkspace {
  std::vector<float> block, normed, q, k, v, attention, projected, gate, up, hidden, head_input, base_logits,
      context_rows;
  std::vector<int32_t> order;
};

void draft(const Drafter& drafter, const TargetHead& head, std::span<const DraftRequest> requests,
           const DraftOptions& options, DraftWorkspace& workspace, std::vector<DraftResult>& results);

// The whole block of one row under teacher forcing: position k's head sees
// tokens[k-1] (the anchor at k = 0). For tests and training.
// Confidences are divided by config.sts temperatures (on the logit) when present.
struct DraftForward {
  std::vector<float> hidden;       // [γ, d] h = rms(Hd, out_norm)
  std::vector<float> base_logits;  // [γ, V] U
  std::vector<float> logits;       // [γ, V] L = U + B
  std::vector<float> confidence;   // [γ]
};

DraftForward draft_teacher_forced(const Drafter& drafter, const TargetHead& head, const DraftContext& context,
                                  int32_t anchor, std::span<const int32_t> tokens);

}  // namespace dspark
