#include "spec/drafter.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numbers>

#include "core/dtype.h"
#include "core/error.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "kernels/cpu/matmul.h"

namespace dspark {
namespace {

enum class Init { Ones, Zeros, Normal };

struct ParameterSpec {
  std::string name;
  Shape shape;
  Init init;
};

// Every parameter with its shape and initialisation, in init order.
std::vector<ParameterSpec> parameter_specs(const DrafterConfig& c, const TargetDims& dims) {
  const int64_t d = c.d_draft, inner = int64_t{c.ff_mult} * c.d_draft, r = c.markov_rank;
  const int64_t H = dims.hidden_size, V = dims.vocab_size, m = static_cast<int64_t>(c.tap_layers.size());
  std::vector<ParameterSpec> specs;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string layer = "bb." + std::to_string(i) + ".";
    specs.push_back({layer + "attn_norm", {d}, Init::Ones});
    for (const char* projection : {"q", "k", "v", "o"}) specs.push_back({layer + projection, {d, d}, Init::Normal});
    specs.push_back({layer + "ff_norm", {d}, Init::Ones});
    specs.push_back({layer + "gate", {d, inner}, Init::Normal});
    specs.push_back({layer + "up", {d, inner}, Init::Normal});
    specs.push_back({layer + "down", {inner, d}, Init::Normal});
  }
  specs.push_back({"W_c", {m * H, d}, Init::Normal});
  specs.push_back({"ctx_norm", {d}, Init::Ones});
  specs.push_back({"tok_proj", {H, d}, Init::Normal});
  specs.push_back({"mask_emb", {c.gamma - 1, d}, Init::Normal});
  specs.push_back({"block_pos", {c.gamma, d}, Init::Normal});
  specs.push_back({"out_norm", {d}, Init::Ones});
  specs.push_back({"out_proj", {d, H}, Init::Normal});
  specs.push_back({"markov.w1", {V, r}, Init::Normal});
  specs.push_back({"markov.w2", {r, V}, Init::Zeros});  // every head starts as pure DFlash
  specs.push_back({"conf.w", {d + r, 1}, Init::Zeros});
  specs.push_back({"conf.b", {1}, Init::Zeros});
  // The sequential head's own tensors come last, so they draw after every shared one.
  if (c.seq_head == "rnn") {
    specs.push_back({"rnn.wH", {r, r}, Init::Normal});
    specs.push_back({"rnn.bH", {r}, Init::Zeros});
    specs.push_back({"rnn.wO", {r, V}, Init::Zeros});
  } else if (c.seq_head == "gru") {
    specs.push_back({"gru.wJ", {2 * r + d, 3 * r}, Init::Normal});
    specs.push_back({"gru.bJ", {3 * r}, Init::Zeros});
  }
  return specs;
}

// xorshift32 with logical shifts on uint32 (the reference's JavaScript used an
// arithmetic >> 17 by accident of the language; DESIGN specifies xorshift32).
class XorShift32 {
 public:
  explicit XorShift32(uint32_t seed) : state_(seed ? seed : 0x9e3779b9u) {}
  double next() {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 17;
    state_ ^= state_ << 5;
    return state_ / 4294967296.0;
  }

 private:
  uint32_t state_;
};

// Box-Muller in pairs, computed in double, stored as f32.
void fill_normal(XorShift32& rng, float* out, long count, double std_dev) {
  for (long i = 0; i < count; i += 2) {
    const double u1 = std::max(rng.next(), 1e-12), u2 = rng.next();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<float>(radius * std::cos(2.0 * std::numbers::pi * u2) * std_dev);
    if (i + 1 < count) out[i + 1] = static_cast<float>(radius * std::sin(2.0 * std::numbers::pi * u2) * std_dev);
  }
}

Json config_to_json(const DrafterConfig& c) {
  Json json = {{"gamma", c.gamma},          {"dDraft", c.d_draft},   {"nLayers", c.num_layers},
               {"nHeads", c.num_heads},     {"markovRank", c.markov_rank}, {"ffMult", c.ff_mult},
               {"tapLayers", c.tap_layers}, {"seqHead", c.seq_head}};
  if (c.sts) {
    json["sts"] = {{"thresholds", c.sts->thresholds}, {"target", c.sts->target}, {"samples", c.sts->samples}};
    if (!c.sts->temperatures.empty()) json["sts"]["temperatures"] = c.sts->temperatures;
  }
  return json;
}

DrafterConfig config_from_json(const Json& json, const std::string& where) {
  DrafterConfig c;
  c.gamma = json_get<int>(json, "gamma", where);
  c.d_draft = json_get<int>(json, "dDraft", where);
  c.num_layers = json_get<int>(json, "nLayers", where);
  c.num_heads = json_get<int>(json, "nHeads", where);
  c.markov_rank = json_get<int>(json, "markovRank", where);
  c.ff_mult = json_get<int>(json, "ffMult", where);
  c.tap_layers = json_get<std::vector<int>>(json, "tapLayers", where);
  c.seq_head = json_get_or<std::string>(json, "seqHead", "markov", where);
  if (json.contains("sts") && json["sts"].is_object()) {
    const Json& sts = json["sts"];
    StsCalibration calibration;
    calibration.thresholds = json_get<std::vector<float>>(sts, "thresholds", where + " sts");
    calibration.temperatures = json_get_or<std::vector<float>>(sts, "temperatures", {}, where + " sts");
    calibration.target = json_get_or<float>(sts, "target", 0.0f, where + " sts");
    calibration.samples = json_get_or<long>(sts, "samples", 0, where + " sts");
    c.sts = calibration;
  }
  return c;
}

}  // namespace

const Tensor& Drafter::parameter(const std::string& name) const {
  auto found = parameters.find(name);
  DSPARK_CHECK(found != parameters.end(), "drafter has no parameter \"", name, "\"");
  return found->second;
}

const uint16_t* Drafter::bf16_of(const std::string& name) const {
  auto found = bf16.find(name);
  return found == bf16.end() ? nullptr : found->second.data();
}

void keep_bf16_weights(Drafter& drafter) {
  drafter.bf16.clear();
  for (const auto& [name, tensor] : drafter.parameters) {
    if (tensor.shape.size() != 2) continue;  // norms and biases never weigh a product (tables of rows get one too)
    std::vector<uint16_t> panels = cpu::pack_bf16_columns(tensor.data, int(tensor.shape[0]), int(tensor.shape[1]));
    if (!panels.empty()) drafter.bf16.emplace(name, std::move(panels));
  }
}

std::vector<int> default_tap_layers(int num_layers) {
  const int last = num_layers - 1, first = std::max(0, num_layers / 2 - 1);
  std::vector<int> taps = {first, (first + last + 1) / 2, last, num_layers};
  taps.erase(std::unique(taps.begin(), taps.end()), taps.end());
  return taps;
}

void validate_drafter_config(const DrafterConfig& c, int target_layers) {
  DSPARK_CHECK(c.gamma >= 1, "drafter gamma must be at least 1, got ", c.gamma);
  DSPARK_CHECK(c.d_draft > 0 && c.num_heads > 0 && c.d_draft % c.num_heads == 0, "drafter width ", c.d_draft,
               " is not a multiple of its ", c.num_heads, " heads");
  DSPARK_CHECK(c.num_layers >= 1 && c.markov_rank >= 1 && c.ff_mult >= 1,
               "drafter layers, Markov rank and MLP multiplier must be positive");
  DSPARK_CHECK(c.seq_head == "markov" || c.seq_head == "rnn" || c.seq_head == "gru", "unknown sequential head \"",
               c.seq_head, "\" (markov, rnn or gru)");
  DSPARK_CHECK(!c.tap_layers.empty(), "the drafter needs at least one tap layer");
  for (int tap : c.tap_layers)
    DSPARK_CHECK(tap >= 0 && tap <= target_layers, "tap layer ", tap, " is outside the target's 0..", target_layers);
  DSPARK_CHECK(c.tap_layers.back() == target_layers, "the last tap layer must be ", target_layers,
               " (the target's post-final-norm hidden, which training reads the target's distribution from)");
  if (c.sts) {
    DSPARK_CHECK(c.sts->thresholds.size() == size_t(c.gamma), "config.sts has ", c.sts->thresholds.size(),
                 " thresholds for gamma ", c.gamma);
    DSPARK_CHECK(c.sts->temperatures.empty() || c.sts->temperatures.size() == size_t(c.gamma), "config.sts has ",
                 c.sts->temperatures.size(), " temperatures for gamma ", c.gamma);
  }
}

std::vector<std::string> drafter_parameter_names(const DrafterConfig& config) {
  std::vector<std::string> names;
  for (const ParameterSpec& spec : parameter_specs(config, TargetDims{1, 1, 0.0f})) names.push_back(spec.name);
  return names;
}

Shape drafter_parameter_shape(const DrafterConfig& config, const TargetDims& dims, const std::string& name) {
  for (const ParameterSpec& spec : parameter_specs(config, dims))
    if (spec.name == name) return spec.shape;
  fail("drafter has no parameter \"", name, "\"");
}

void draw_normal(float* out, long count, double std_dev, uint32_t seed) {
  XorShift32 rng(seed);
  fill_normal(rng, out, count, std_dev);
}

Drafter init_drafter(const DrafterConfig& config, const TargetDims& dims, const std::string& target_id, uint32_t seed) {
  validate_drafter_config(config, config.tap_layers.empty() ? 0 : config.tap_layers.back());
  Drafter drafter;
  drafter.config = config;
  drafter.dims = dims;
  drafter.target_id = target_id;
  XorShift32 rng(seed);
  for (const ParameterSpec& spec : parameter_specs(config, dims)) {
    Tensor tensor = Tensor::zeros(spec.shape);
    if (spec.init == Init::Ones) std::fill(tensor.data, tensor.data + tensor.numel(), 1.0f);
    if (spec.init == Init::Normal) fill_normal(rng, tensor.data, tensor.numel(), 0.02);
    drafter.names.push_back(spec.name);
    drafter.parameters.emplace(spec.name, std::move(tensor));
  }
  return drafter;
}

void save_drafter(const Drafter& drafter, const std::filesystem::path& directory, Dtype dtype) {
  std::filesystem::create_directories(directory);
  std::vector<std::vector<uint16_t>> converted;
  std::vector<SafetensorsWriteEntry> entries;
  for (const std::string& name : drafter.names) {
    const Tensor& tensor = drafter.parameter(name);
    if (dtype == Dtype::F32) {
      entries.push_back({name, Dtype::F32, tensor.shape, tensor.data});
      continue;
    }
    DSPARK_CHECK(dtype == Dtype::BF16, "drafter checkpoints are F32 or BF16");
    auto& bits = converted.emplace_back(static_cast<size_t>(tensor.numel()));
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = f32_to_bf16(tensor.data[i]);
    entries.push_back({name, Dtype::BF16, tensor.shape, bits.data()});
  }
  write_safetensors(directory / "model.safetensors", entries, {{"format", "pt"}});
  Json metadata = drafter.metadata.is_object() ? drafter.metadata : Json::object();
  metadata["kind"] = "dspark-drafter";
  metadata["variant"] = "dspark";
  metadata["version"] = 1;
  metadata["target_id"] = drafter.target_id;
  Json config = metadata.contains("config") && metadata["config"].is_object() ? metadata["config"] : Json::object();
  config.erase("sts");  // rewritten from the struct (or dropped when it has none)
  config.update(config_to_json(drafter.config));
  metadata["config"] = config;
  metadata["dims"] = {{"hiddenSize", drafter.dims.hidden_size}, {"vocabSize", drafter.dims.vocab_size},
                      {"eps", drafter.dims.eps}};
  metadata["param_names"] = drafter.names;
  write_text_file_atomic(directory / "dspark.json", metadata.dump(2) + "\n");
}

Drafter load_drafter(const std::filesystem::path& directory) {
  DSPARK_CHECK(std::filesystem::is_directory(directory), "drafter directory ", directory.string(), " does not exist");
  const auto json_path = directory / "dspark.json";
  const std::string where = json_path.string();
  Drafter drafter;
  drafter.metadata = read_json_file(json_path);
  const Json& metadata = drafter.metadata;
  DSPARK_CHECK(json_get_or<std::string>(metadata, "kind", "", where) == "dspark-drafter", where,
               ": not a dspark drafter (\"kind\" must be \"dspark-drafter\")");
  const std::string variant = json_get_or<std::string>(metadata, "variant", "", where);
  DSPARK_CHECK(variant == "dspark" || variant == "dflash", where, ": unsupported variant \"", variant,
               "\" (dspark, or the legacy dflash)");
  drafter.target_id = json_get_or<std::string>(metadata, "target_id", "", where);
  DSPARK_CHECK(metadata.contains("config"), where, ": missing \"config\"");
  drafter.config = config_from_json(metadata["config"], where + " config");
  DSPARK_CHECK(metadata.contains("dims"), where, ": missing \"dims\"");
  drafter.dims.hidden_size = json_get<int>(metadata["dims"], "hiddenSize", where + " dims");
  drafter.dims.vocab_size = json_get<int>(metadata["dims"], "vocabSize", where + " dims");
  drafter.dims.eps = json_get_or<float>(metadata["dims"], "eps", 1e-6f, where + " dims");
  validate_drafter_config(drafter.config, drafter.config.tap_layers.back());

  const SafetensorsCheckpoint checkpoint(directory);
  for (const ParameterSpec& spec : parameter_specs(drafter.config, drafter.dims)) {
    // Copied: mapped weights are read-only, and training updates them in place.
    const Tensor stored = checkpoint.load(spec.name, spec.shape);
    Tensor owned = Tensor::zeros(spec.shape);
    std::copy_n(stored.data, stored.numel(), owned.data);
    drafter.names.push_back(spec.name);
    drafter.parameters.emplace(spec.name, std::move(owned));
  }
  return drafter;
}

void check_drafter_matches_target(const Drafter& drafter, const ModelConfig& target, const std::string& target_id) {
  DSPARK_CHECK(drafter.dims.hidden_size == target.hidden_size && drafter.dims.vocab_size == target.vocab_size,
               "the drafter was made for a target with hidden size ", drafter.dims.hidden_size, " and vocabulary ",
               drafter.dims.vocab_size, "; this target has ", target.hidden_size, " and ", target.vocab_size);
  DSPARK_CHECK(drafter.config.tap_layers.back() == target.num_layers, "the drafter taps layer ",
               drafter.config.tap_layers.back(), " as the post-final-norm hidden; this target has ",
               target.num_layers, " layers");
  if (!drafter.target_id.empty() && drafter.target_id != target_id)
    std::fprintf(stderr, "warning: the drafter was trained for target \"%s\", not \"%s\"\n", drafter.target_id.c_str(),
                 target_id.c_str());
}

std::string target_id_of(const std::filesystem::path& target_directory) {
  std::filesystem::path normal = std::filesystem::absolute(target_directory).lexically_normal();
  if (normal.filename().empty()) normal = normal.parent_path();  // "dir/"
  return normal.filename().string();
}

}  // namespace dspark
