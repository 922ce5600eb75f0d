// The training golden (tests/golden/train, made by tests/tools/make_train_golden.py
// with PyTorch autograd in float64): one fixed batch, a drafter per head with
// the script's parameters, the target head, the loss weights, and the
// expected loss terms (reference["heads"][head]) and gradients
// (expected "grad.<name>"). Read the same way by the CPU and the CUDA tests.
#pragma once
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/json.h"
#include "core/safetensors.h"
#include "golden.h"
#include "gradient_check.h"
#include "spec/draft.h"
#include "spec/drafter.h"
#include "train/loss.h"
#include "train/train_batch.h"

namespace dspark::testing {

struct TrainGolden {
  Json reference;
  std::unique_ptr<SafetensorsFile> expected;  // param.<name> and grad.<name> for this head
  Drafter drafter;                             // the script's parameters, init order
  Tensor embedding, lm_head;                   // [V, H]
  TrainBatch batch;
  LossWeights weights;

  TargetHead head() const { return {embedding.data, lm_head.data}; }
};

inline TrainGolden load_train_golden(const std::string& seq_head) {
  const auto directory = golden_model("train");
  TrainGolden golden;
  golden.reference = read_json_file(directory / "reference.json");
  golden.expected = std::make_unique<SafetensorsFile>(directory / (seq_head + ".safetensors"));
  const SafetensorsFile inputs(directory / "inputs.safetensors");
  const Json& json_config = golden.reference["config"];
  DrafterConfig config;
  config.gamma = json_config["gamma"];
  config.d_draft = json_config["dDraft"];
  config.num_layers = json_config["nLayers"];
  config.num_heads = json_config["nHeads"];
  config.markov_rank = json_config["markovRank"];
  config.ff_mult = json_config["ffMult"];
  config.tap_layers = json_config["tapLayers"].get<std::vector<int>>();
  config.seq_head = seq_head;
  const Json& json_dims = golden.reference["dims"];
  const TargetDims dims{json_dims["hiddenSize"], json_dims["vocabSize"], json_dims["eps"]};
  golden.drafter = init_drafter(config, dims, "golden", 1);
  for (const std::string& name : golden.drafter.names) {
    if (!golden.expected->contains("param." + name)) continue;  // the caller compares the name lists
    const Tensor stored = golden.expected->load_f32("param." + name);
    Tensor& parameter = golden.drafter.parameters.at(name);
    DSPARK_CHECK(stored.shape == parameter.shape, "train golden: ", name, " is ", shape_string(stored.shape),
                 ", the drafter's ", shape_string(parameter.shape));
    std::copy_n(stored.data, stored.numel(), parameter.data);
  }
  golden.embedding = inputs.load_f32("embedding");
  golden.lm_head = inputs.load_f32("lm_head");
  const Tensor context_rows = inputs.load_f32("context_rows"), target_hidden = inputs.load_f32("target_hidden");

  const Json& json_batch = golden.reference["batch"];
  TrainBatch& batch = golden.batch;
  batch.gamma = config.gamma;
  batch.hidden_size = dims.hidden_size;
  batch.tap_width = static_cast<int>(config.tap_layers.size()) * dims.hidden_size;
  batch.context_offsets = json_batch["context_offsets"].get<std::vector<int>>();
  batch.context_rows.assign(context_rows.data, context_rows.data + context_rows.numel());
  batch.anchors = json_batch["anchors"].get<std::vector<int32_t>>();
  for (const auto& row : json_batch["targets"])
    for (int32_t id : row.get<std::vector<int32_t>>()) batch.targets.push_back(id);
  for (const auto& row : json_batch["mask"])
    for (float value : row.get<std::vector<float>>()) batch.mask.push_back(value);
  batch.target_hidden.assign(target_hidden.data, target_hidden.data + target_hidden.numel());

  const Json& json_weights = golden.reference["weights"];
  golden.weights.ce = json_weights["ce"];
  golden.weights.l1 = json_weights["l1"];
  golden.weights.bce = json_weights["bce"];
  golden.weights.gamma_decay = json_weights["gammaDecay"];
  return golden;
}

// A random batch for `drafter`: ragged contexts (lengths[a] rows, 0 and 1
// allowed), the last masked[a] block positions of anchor a masked (the block
// running off the end), targets drawn from [0, target_range) (a small range
// repeats tokens: shared Markov rows), context rows and target rows uniform.
inline TrainBatch random_train_batch(const Drafter& drafter, uint64_t seed, const std::vector<int>& lengths,
                                     const std::vector<int>& masked, int target_range) {
  const int gamma = drafter.config.gamma, H = drafter.dims.hidden_size, V = drafter.dims.vocab_size;
  Rng rng(seed);
  TrainBatch batch;
  batch.gamma = gamma;
  batch.hidden_size = H;
  batch.tap_width = static_cast<int>(drafter.config.tap_layers.size()) * H;
  batch.context_offsets = {0};
  for (size_t a = 0; a < lengths.size(); ++a) {
    batch.context_offsets.push_back(batch.context_offsets.back() + lengths[a]);
    batch.anchors.push_back(static_cast<int32_t>(rng.next() % V));
    for (int k = 0; k < gamma; ++k) {
      batch.targets.push_back(static_cast<int32_t>(rng.next() % target_range));
      batch.mask.push_back(k < gamma - masked[a] ? 1.0f : 0.0f);
    }
  }
  batch.context_rows = random_values(rng, size_t(batch.context_offsets.back()) * batch.tap_width, 1.0f);
  batch.target_hidden = random_values(rng, size_t(batch.size()) * gamma * H, 1.5f);
  return batch;
}

}  // namespace dspark::testing
