// The DSpark drafter (DESIGN.md §2): its configuration, its parameters in
// checkpoint order, the reproducible initialisation, and the checkpoint
// directory format (dspark.json + model.safetensors).
//
// Shape letters: γ block, d draft width, H target hidden, V vocab, m taps,
// r Markov rank, f MLP multiplier, nh heads. Weights are stored [in, out].
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/json.h"
#include "core/tensor.h"
#include "model/config.h"

namespace dspark {

// Confidence calibration fitted by `dspark calibrate` (DESIGN §5), kept in
// dspark.json config.sts. Absent: no pruning by thresholds.
struct StsCalibration {
  std::vector<float> thresholds;    // [γ] keep position k only if c_k >= thresholds[k]
  std::vector<float> temperatures;  // [γ] on the confidence logit (empty: 1)
  float target = 0.0f;              // the precision the thresholds were fit for
  long samples = 0;                 // verify outcomes the fit saw
};

struct DrafterConfig {
  int gamma = 7;                    // γ: tokens drafted per round
  int d_draft = 1024;               // d
  int num_layers = 5;
  int num_heads = 8;                // nh; d must be a multiple
  int markov_rank = 256;            // r
  int ff_mult = 2;                  // f
  std::vector<int> tap_layers;      // m target tap indices; the last is L (post-final-norm)
  std::string seq_head = "markov";  // "markov" | "rnn" | "gru"
  std::optional<StsCalibration> sts;
};

// What the drafter must agree on with its target.
struct TargetDims {
  int hidden_size = 0;  // H
  int vocab_size = 0;   // V
  float eps = 1e-6f;    // the target's RMSNorm epsilon, used by every drafter norm
};

struct Drafter {
  DrafterConfig config;
  TargetDims dims;
  std::string target_id;
  std::vector<std::string> names;           // parameter (and init) order
  std::map<std::string, Tensor> parameters;  // name -> f32 tensor
  Json metadata = Json::object();           // dspark.json as read: unknown fields survive a save
  // name -> a matrix's bf16 bit patterns in cpu::pack_bf16_columns' panels
  // when every element is a bf16 value (a bf16 checkpoint): its few-row
  // products read these, half the bytes (with cpu::bf16_products(), of bf16
  // activations, as the CUDA drafter's are). Filled for decoding by
  // keep_bf16_weights; empty while training, whose updates would leave it
  // stale.
  std::map<std::string, std::vector<uint16_t>> bf16;

  const Tensor& parameter(const std::string& name) const;
  const float* operator[](const std::string& name) const { return parameter(name).data; }
  const uint16_t* bf16_of(const std::string& name) const;  // null when `bf16` lacks it
};

// Fills drafter.bf16 for every matrix that is exactly bf16 (for decoding only).
void keep_bf16_weights(Drafter& drafter);

// Three target layers spread over the upper half, then L (DESIGN §2); e.g.
// [20, 31, 41, 42] for L = 42.
std::vector<int> default_tap_layers(int num_layers);

// Checks a config on its own (sizes, head, taps within 0..target_layers).
void validate_drafter_config(const DrafterConfig& config, int target_layers);

// Parameter names in init order, and each one's shape.
std::vector<std::string> drafter_parameter_names(const DrafterConfig& config);
Shape drafter_parameter_shape(const DrafterConfig& config, const TargetDims& dims, const std::string& name);

// The reproducible initialisation: xorshift32 + Box-Muller, only the
// N(0, 0.02) tensors draw, in parameter order (so the sequential head's own
// tensors, appended last, leave every shared tensor identical across heads).
Drafter init_drafter(const DrafterConfig& config, const TargetDims& dims, const std::string& target_id, uint32_t seed);
// `count` N(0, std_dev) values from the initialisation's generator (xorshift32
// + Box-Muller) seeded with `seed`: a tensor the init leaves zero, drawn
// (benchmarks give a fresh drafter's markov.w2 work to do).
void draw_normal(float* out, long count, double std_dev, uint32_t seed);

// dspark.json + model.safetensors, both written atomically; parameters as F32 or BF16.
void save_drafter(const Drafter& drafter, const std::filesystem::path& directory, Dtype dtype = Dtype::F32);

// Reads a checkpoint directory (variant "dspark", or the legacy "dflash").
// Missing files, a wrong kind, or missing / mis-shaped tensors are errors.
Drafter load_drafter(const std::filesystem::path& directory);

// Refuses a drafter whose hidden size or vocabulary differs from the target's;
// a different target_id only warns (on stderr).
void check_drafter_matches_target(const Drafter& drafter, const ModelConfig& target, const std::string& target_id);

// The id a target is recorded under in dspark.json: its directory name.
std::string target_id_of(const std::filesystem::path& target_directory);

}  // namespace dspark
