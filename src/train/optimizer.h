// The optimizer side of training (DESIGN.md §4): AdamW over f32 master
// weights, gradient clipping by global norm, and the learning-rate schedule
// (linear warmup, then cosine decay). Nothing here draws random numbers: a
// run is reproducible from its seed through the data sampler alone.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace dspark {

using TensorMap = std::map<std::string, Tensor>;

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double epsilon = 1e-8;
  double weight_decay = 0.01;  // decoupled: θ ← θ·(1 - lr·wd), only for tensors that decay
};

// Which drafter tensors weight decay applies to: the matrices that multiply
// activations (q, k, v, o, gate, up, down, W_c, tok_proj, out_proj,
// markov.w2, conf.w, rnn.wH, rnn.wO, gru.wJ). Not decayed: vectors (every
// norm weight, every bias: conf.b, rnn.bH, gru.bJ) and the lookup tables
// (markov.w1, mask_emb, block_pos), whose rows are read, not multiplied, and
// get a gradient only when used: decay would shrink rarely used rows (rare
// tokens' Markov embeddings) toward zero for no reason.
bool drafter_parameter_decays(const std::string& name, const Shape& shape);

// AdamW exactly as torch.optim.AdamW (amsgrad off) steps one f32 tensor:
//   θ ← θ·(1 - lr·wd)
//   m ← β1·m + (1-β1)·g,  v ← β2·v + (1-β2)·g²
//   θ ← θ - lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + ε)
// with t the 1-based step count. The moments are f32, one pair per tensor.
class AdamW {
 public:
  // `decays` holds the names weight decay applies to; moments start at zero.
  AdamW(const TensorMap& parameters, std::vector<std::string> decays, const AdamWOptions& options);

  // One update of every parameter that has a gradient (same names and shapes).
  void step(TensorMap& parameters, const TensorMap& gradients, double learning_rate);

  long steps() const { return steps_; }
  const AdamWOptions& options() const { return options_; }
  const std::vector<std::string>& decayed() const { return decays_; }
  // The moments, for checkpoints; restore() puts back what these returned.
  const TensorMap& first_moments() const { return first_; }
  const TensorMap& second_moments() const { return second_; }
  void restore(long steps, const TensorMap& first, const TensorMap& second);

 private:
  AdamWOptions options_;
  std::vector<std::string> decays_;
  TensorMap first_, second_;
  long steps_ = 0;
};

// sqrt(Σ g²) over every tensor (accumulated in double, in name order).
double global_gradient_norm(const TensorMap& gradients);

// Scales every gradient by max_norm / (norm + 1e-6) when the global norm
// exceeds max_norm (torch.nn.utils.clip_grad_norm_); returns the norm before.
double clip_gradients_by_global_norm(TensorMap& gradients, double max_norm);

// Linear warmup to the peak over the first `warmup_steps` updates (update s,
// 0-based, gets peak·(s+1)/warmup), then cosine decay from the peak to
// final_fraction·peak over the remaining updates:
//   lr(s) = peak·(f + (1-f)·(1 + cos(π·(s - warmup)/(total - warmup)))/2).
struct LearningRateSchedule {
  double peak = 3e-4;
  long warmup_steps = 0;
  long total_steps = 1;
  double final_fraction = 0.1;  // f
  double at(long step) const;
};

}  // namespace dspark
