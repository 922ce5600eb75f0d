// config.json parsing: both rope layouts, EOS ids, and clear refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "core/error.h"
#include "core/file.h"
#include "golden.h"
#include "model/config.h"

namespace dspark {
namespace {

using testing::golden_model;
using testing::TemporaryDirectory;

std::filesystem::path write_config(const TemporaryDirectory& directory, const Json& config) {
  write_text_file_atomic(directory.path / "config.json", config.dump());
  return directory.path;
}

Json golden_config(const std::string& name) { return read_json_file(golden_model(name) / "config.json"); }

TEST(ModelConfig, GoldenQwen3) {
  const ModelConfig config = load_model_config(golden_model("qwen3"));
  EXPECT_EQ(config.family, "qwen3");
  EXPECT_EQ(config.head_dim, 32);  // explicit, not hidden / heads = 16
  EXPECT_TRUE(config.qk_norm);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_EQ(config.rope_theta, 1e6);
  EXPECT_EQ(config.eos_token_ids.size(), 2u);
  EXPECT_FALSE(config.bos_token_id.has_value());
}

TEST(ModelConfig, OlderRopeLayoutReadsTheSame) {
  // transformers 4.x writes rope_theta and rope_scaling at the top level.
  Json old_style = golden_config("llama");
  const Json rope = old_style["rope_parameters"];
  old_style.erase("rope_parameters");
  old_style["rope_theta"] = rope["rope_theta"];
  old_style["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", rope["factor"]},
                               {"low_freq_factor", rope["low_freq_factor"]},
                               {"high_freq_factor", rope["high_freq_factor"]},
                               {"original_max_position_embeddings", rope["original_max_position_embeddings"]}};
  TemporaryDirectory directory;
  const ModelConfig config = load_model_config(write_config(directory, old_style));
  const ModelConfig golden = load_model_config(golden_model("llama"));
  EXPECT_EQ(rope_inverse_frequencies(config), rope_inverse_frequencies(golden));
  EXPECT_EQ(config.rope_scaling.type, "llama3");
}

TEST(ModelConfig, Llama3ScalingBands) {
  // head_dim 16, theta 5e5, original context 64: frequency 0 is short-wave
  // (kept), 1 falls in the smoothed band, 2.. are long-wave (divided by 8).
  const ModelConfig config = load_model_config(golden_model("llama"));
  const auto scaled = rope_inverse_frequencies(config);
  ModelConfig unscaled_config = config;
  unscaled_config.rope_scaling = {};
  const auto plain = rope_inverse_frequencies(unscaled_config);
  EXPECT_EQ(scaled[0], plain[0]);
  EXPECT_LT(scaled[1], plain[1]);
  EXPECT_GT(scaled[1], plain[1] / 8.0);
  for (size_t i = 2; i < scaled.size(); ++i) EXPECT_DOUBLE_EQ(scaled[i], plain[i] / 8.0);
}

TEST(ModelConfig, EosIdsFromConfigAndGenerationConfigTogether) {
  TemporaryDirectory directory;
  Json config = golden_config("qwen3");
  config["eos_token_id"] = 7;
  write_config(directory, config);
  write_text_file_atomic(directory.path / "generation_config.json", R"({"eos_token_id": [9, 7]})");
  EXPECT_EQ(load_model_config(directory.path).eos_token_ids, (std::vector<int>{7, 9}));
}

TEST(ModelConfig, ClearRefusals) {
  auto message_of = [](const std::filesystem::path& path) {
    return testing::error_of([&] { load_model_config(path); });
  };
  EXPECT_NE(message_of("/no/such/model").find("does not exist"), std::string::npos);
  TemporaryDirectory empty;
  EXPECT_NE(message_of(empty.path).find("missing file"), std::string::npos);

  Json config = golden_config("qwen3");
  config["model_type"] = "gpt_neox";
  TemporaryDirectory unknown;
  const std::string message = message_of(write_config(unknown, config));
  EXPECT_NE(message.find("unsupported model_type \"gpt_neox\""), std::string::npos) << message;
  EXPECT_NE(message.find("qwen3, llama"), std::string::npos) << message;

  config = golden_config("qwen3");
  config["num_key_value_heads"] = 3;
  TemporaryDirectory gqa;
  EXPECT_NE(message_of(write_config(gqa, config)).find("not a multiple"), std::string::npos);

  config = golden_config("qwen3");
  config.erase("hidden_size");
  TemporaryDirectory missing;
  EXPECT_NE(message_of(write_config(missing, config)).find("missing field \"hidden_size\""), std::string::npos);

  config = golden_config("qwen3");
  config["use_sliding_window"] = true;
  TemporaryDirectory sliding;
  EXPECT_NE(message_of(write_config(sliding, config)).find("sliding-window"), std::string::npos);
}

}  // namespace
}  // namespace dspark
