// ModelConfig: what a target transformer is, read from an HF config.json.
// Supported families: "qwen3" and "llama" (and their variants that only
// differ in these fields).
#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace dspark {

struct RopeScaling {
  std::string type = "default";    // "default" | "llama3"
  double factor = 1.0;             // llama3: the context extension factor
  double low_frequency_factor = 1.0;
  double high_frequency_factor = 4.0;
  int original_max_positions = 8192;
};

struct ModelConfig {
  std::string family;              // "qwen3" | "llama"
  int vocab_size = 0;              // V
  int hidden_size = 0;             // H
  int intermediate_size = 0;       // F
  int num_layers = 0;              // L
  int num_heads = 0;               // nh
  int num_kv_heads = 0;            // nkv (divides nh: grouped-query attention)
  int head_dim = 0;                // hd (need not be H / nh)
  int max_positions = 0;           // the context length
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  bool qk_norm = false;            // Qwen3: RMSNorm over head_dim on q and k before RoPE
  bool attention_bias = false;     // q/k/v (and o) projection biases
  bool mlp_bias = false;
  std::vector<int> eos_token_ids;  // config.json and generation_config.json together
  std::optional<int> bos_token_id;
};

// Reads <directory>/config.json (and generation_config.json if present).
// A missing directory or file, an unsupported model_type or an inconsistent
// field is a dspark::Error naming the file.
ModelConfig load_model_config(const std::filesystem::path& directory);

// The rotary inverse frequencies [head_dim / 2], with the config's scaling applied.
std::vector<double> rope_inverse_frequencies(const ModelConfig& config);

}  // namespace dspark
