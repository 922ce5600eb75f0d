// The drafter trainer (DESIGN.md §4): steps of drafter_loss + AdamW over
// anchors sampled from regenerated data, held-out evaluation of the loss
// terms and τ̂, checkpoints, exact resumption, and a per-step log.
//
// Output directory (DRAFT):
//   dspark.json + model.safetensors   the drafter at the latest checkpoint (save_drafter)
//   best/                             the drafter at the best held-out τ̂ so far
//   training_state.json               the commit record of the latest checkpoint: step,
//                                     options, best τ̂, data identity, and the name of
//   training_state-<step>.safetensors  f32 master weights and AdamW moments at that step
//   train_log.jsonl                   one line per step (split "train") and per
//                                     evaluation (split "held_out")
// Each file is written atomically; training_state.json is written last and
// names its state file, so a crash between writes leaves the previous
// checkpoint whole. The sampler draws step s's anchors from its own stream
// Rng(seed ^ 0xd1b54a32d192ed03·(s+1)), so the random state at a checkpoint
// is the step itself and a resumed run draws exactly what an uninterrupted
// one would: on the CPU, N steps straight == k steps, stop, resume, N - k
// steps, bit for bit.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>

#include "core/json.h"
#include "spec/draft.h"
#include "spec/drafter.h"
#include "train/anchors.h"
#include "train/dataset.h"
#include "train/loss.h"
#include "train/optimizer.h"

namespace dspark {

struct TrainOptions {
  long iterations = 1000;          // optimizer steps in all (the schedule's length)
  int batch = 16;                  // anchors per step
  int max_context = 1024;          // context rows per anchor: [max(0, t - max_context), t)
  double learning_rate = 3e-4;     // the schedule's peak
  long warmup = 100;               // linear warmup steps
  double final_lr_fraction = 0.1;  // the cosine ends at this fraction of the peak
  AdamWOptions adamw;
  double clip_norm = 1.0;  // global gradient norm clip
  LossWeights loss;
  uint64_t seed = 0;                // the sampler's seed (the drafter's init seed is the caller's)
  double held_out_fraction = 0.05;  // sequences kept out of training for evaluation
  int eval_anchors = 512;           // held-out anchors per evaluation (all of them when fewer)
  long eval_every = 100;            // 0: evaluate only at the start and the end
  long save_every = 500;            // 0: checkpoint only at the end
  bool show_progress = true;
  // "cpu" or "cuda" (train/train_step.h): where the steps and evaluations run. Not part of the
  // trajectory's options: a run may be resumed on the other device (the CUDA step is
  // reproducible on one GPU, not bit-identical to the CPU's).
  std::string device = "cpu";
  // Steps whose batches can arrive packed (the CUDA step: TrainStep::batch_staging) get them
  // from a BatchPipeline (train/batch_pipeline.h): the next batch is packed and copied while
  // the current step runs. The same batches either way; false: build and upload each batch
  // between steps (to compare).
  bool prefetch = true;
  long stop_after = -1;               // for tests: stop after this step, checkpointing, as an interruption would
  std::function<bool()> interrupted;  // polled after every step (e.g. SIGINT): checkpoint and stop
};

// The options that shape the trajectory (everything but iterations, the
// evaluation / checkpoint cadence and progress), as stored in training_state.json.
Json train_options_to_json(const TrainOptions& options);
// `base` with every field present in `json` replaced.
TrainOptions train_options_from_json(const Json& json, TrainOptions base);

// Held-out evaluation: the loss terms over a fixed set of anchors.
struct EvalResult {
  LossTerms terms;
  int anchors = 0;
};

// The loss terms of `drafter` over `anchors`, in chunks of options.batch,
// without gradients: CE, L1, BCE and the loss are averaged with each
// position's weight w_k·mask (as within a batch), τ̂ over anchors.
EvalResult evaluate_drafter(const Drafter& drafter, const TargetHead& head, const Dataset& data,
                            std::span<const Anchor> anchors, const TrainOptions& options);

struct TrainSummary {
  long start_step = 0;    // where this call began (> 0 when resumed)
  long steps = 0;         // completed steps when it returned
  bool finished = false;  // steps == iterations
  LossTerms last_train;   // the last step's batch
  EvalResult first_eval;  // at start_step (the untrained drafter when starting fresh)
  EvalResult last_eval;
  bool evaluated = false;  // there is held-out data
  double best_tau = 0.0;   // best held-out τ̂, and the step it was reached at
  long best_step = -1;
  double seconds = 0.0;
  double positions_per_second = 0.0;  // trained block positions per second
};

inline constexpr const char* kTrainingStateFile = "training_state.json";
inline constexpr const char* kTrainLogFile = "train_log.jsonl";

// The commit record of the checkpoint in `output`, or null when there is none.
Json read_training_state(const std::filesystem::path& output);

// Trains `drafter` in place. Fresh (resume false): `output` must not hold a
// training run. Resuming: the drafter's weights, the optimizer, the step and
// the best τ̂ come from the checkpoint in `output`; the options that shape
// the trajectory must equal the stored ones (else a clear error).
TrainSummary train_drafter(Drafter& drafter, const TargetHead& head, const Dataset& data, const TrainOptions& options,
                           const std::filesystem::path& output, bool resume);

}  // namespace dspark
