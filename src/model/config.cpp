#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"
#include "core/json.h"

namespace dspark {
namespace {

// eos_token_id is an int, a list of ints, or null.
void add_token_ids(const Json& value, std::vector<int>& ids) {
  if (value.is_number_integer()) ids.push_back(value.get<int>());
  if (value.is_array())
    for (const auto& id : value)
      if (id.is_number_integer()) ids.push_back(id.get<int>());
}

RopeScaling read_rope_scaling(const Json& scaling, const std::string& where) {
  RopeScaling result;
  if (scaling.is_null()) return result;
  DSPARK_CHECK(scaling.is_object(), where, ": rope scaling must be an object");
  result.type = json_get_or<std::string>(scaling, "rope_type",
                                         json_get_or<std::string>(scaling, "type", "default", where), where);
  if (result.type == "default") return result;
  DSPARK_CHECK(result.type == "llama3", where, ": unsupported rope scaling \"", result.type,
               "\" (supported: default, llama3)");
  result.factor = json_get<double>(scaling, "factor", where);
  result.low_frequency_factor = json_get<double>(scaling, "low_freq_factor", where);
  result.high_frequency_factor = json_get<double>(scaling, "high_freq_factor", where);
  result.original_max_positions = json_get<int>(scaling, "original_max_position_embeddings", where);
  return result;
}

}  // namespace

ModelConfig load_model_config(const std::filesystem::path& directory) {
  DSPARK_CHECK(std::filesystem::is_directory(directory), "model directory ", directory.string(),
               " does not exist");
  const auto path = directory / "config.json";
  const std::string where = path.string();
  const Json json = read_json_file(path);
  ModelConfig config;
  config.family = json_get_or<std::string>(json, "model_type", "", where);
  DSPARK_CHECK(config.family == "qwen3" || config.family == "llama", where,
               ": unsupported model_type \"", config.family, "\" (supported: qwen3, llama)");
  config.vocab_size = json_get<int>(json, "vocab_size", where);
  config.hidden_size = json_get<int>(json, "hidden_size", where);
  config.intermediate_size = json_get<int>(json, "intermediate_size", where);
  config.num_layers = json_get<int>(json, "num_hidden_layers", where);
  config.num_heads = json_get<int>(json, "num_attention_heads", where);
  config.num_kv_heads = json_get_or<int>(json, "num_key_value_heads", config.num_heads, where);
  DSPARK_CHECK(config.num_heads > 0 && config.hidden_size > 0, where, ": bad head count or hidden size");
  config.head_dim = json_get_or<int>(json, "head_dim", config.hidden_size / config.num_heads, where);
  config.max_positions = json_get<int>(json, "max_position_embeddings", where);
  config.rms_norm_eps = json_get_or<float>(json, "rms_norm_eps", 1e-6f, where);
  config.tie_word_embeddings = json_get_or<bool>(json, "tie_word_embeddings", false, where);
  config.attention_bias = json_get_or<bool>(json, "attention_bias", false, where);
  config.mlp_bias = json_get_or<bool>(json, "mlp_bias", false, where);
  config.qk_norm = config.family == "qwen3";

  // transformers 5 writes rope settings as rope_parameters {rope_type, rope_theta, ...};
  // older checkpoints as rope_theta + rope_scaling.
  if (json.contains("rope_parameters") && json["rope_parameters"].is_object()) {
    const Json& rope = json["rope_parameters"];
    config.rope_theta = json_get_or<double>(rope, "rope_theta", 10000.0, where);
    config.rope_scaling = read_rope_scaling(rope, where);
  } else {
    config.rope_theta = json_get_or<double>(json, "rope_theta", 10000.0, where);
    config.rope_scaling = read_rope_scaling(json.value("rope_scaling", Json()), where);
  }
  DSPARK_CHECK(!json_get_or<bool>(json, "use_sliding_window", false, where), where,
               ": sliding-window attention is not supported");
  if (json.contains("layer_types") && json["layer_types"].is_array())
    for (const auto& type : json["layer_types"])
      DSPARK_CHECK(type == "full_attention", where, ": layer type ", type.dump(), " is not supported");
  const std::string activation = json_get_or<std::string>(json, "hidden_act", "silu", where);
  DSPARK_CHECK(activation == "silu", where, ": hidden_act \"", activation, "\" is not supported (silu)");

  DSPARK_CHECK(config.vocab_size > 0 && config.num_layers > 0 && config.intermediate_size > 0 &&
                   config.max_positions > 0 && config.head_dim > 0 && config.head_dim % 2 == 0,
               where, ": sizes must be positive and head_dim even");
  DSPARK_CHECK(config.num_kv_heads > 0 && config.num_heads % config.num_kv_heads == 0, where,
               ": num_attention_heads ", config.num_heads, " is not a multiple of num_key_value_heads ",
               config.num_kv_heads);

  add_token_ids(json.value("eos_token_id", Json()), config.eos_token_ids);
  if (json.contains("bos_token_id") && json["bos_token_id"].is_number_integer())
    config.bos_token_id = json["bos_token_id"].get<int>();
  const auto generation_path = directory / "generation_config.json";
  if (std::filesystem::exists(generation_path)) {
    const Json generation = read_json_file(generation_path);
    add_token_ids(generation.value("eos_token_id", Json()), config.eos_token_ids);
  }
  std::sort(config.eos_token_ids.begin(), config.eos_token_ids.end());
  config.eos_token_ids.erase(std::unique(config.eos_token_ids.begin(), config.eos_token_ids.end()),
                             config.eos_token_ids.end());
  return config;
}

std::vector<double> rope_inverse_frequencies(const ModelConfig& config) {
  const int half = config.head_dim / 2;
  std::vector<double> frequencies(half);
  for (int i = 0; i < half; ++i)
    frequencies[i] = 1.0 / std::pow(config.rope_theta, 2.0 * i / config.head_dim);
  const RopeScaling& scaling = config.rope_scaling;
  if (scaling.type == "llama3") {
    // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    // the band between is interpolated smoothly.
    const double low_wavelength = scaling.original_max_positions / scaling.low_frequency_factor;
    const double high_wavelength = scaling.original_max_positions / scaling.high_frequency_factor;
    for (double& frequency : frequencies) {
      const double wavelength = 2.0 * std::numbers::pi / frequency;
      if (wavelength > low_wavelength) {
        frequency /= scaling.factor;
      } else if (wavelength >= high_wavelength) {
        const double smooth = (scaling.original_max_positions / wavelength - scaling.low_frequency_factor) /
                              (scaling.high_frequency_factor - scaling.low_frequency_factor);
        frequency = (1.0 - smooth) * frequency / scaling.factor + smooth * frequency;
      }
    }
  }
  return frequencies;
}

}  // namespace dspark
