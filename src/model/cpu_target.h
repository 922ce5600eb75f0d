// CpuTarget: the Target interface over the f32 reference forward.
#pragma once
#include <limits>
#include <map>

#include "kernels/cpu/matmul.h"
#include "model/target.h"
#include "model/transformer.h"

namespace dspark {

class CpuTarget final : public Target {
 public:
  explicit CpuTarget(Transformer model) : model_(std::move(model)) {}
  const ModelConfig& config() const override { return model_.config; }
  std::string device_description() const override { return cpu::bf16_products() ? "cpu (bf16 products)" : "cpu (f32)"; }
  int create_sequence(int capacity) override;
  void release_sequence(int sequence) override;
  int sequence_length(int sequence) const override;
  void truncate_sequence(int sequence, int length) override;
  void forward(std::span<const TargetInput> inputs, const TargetRequest& request,
               TargetResult& result) override;

  // bf16 weights take the few-row kernels at any row count (cpu::matmul_forward), f32 ones up to kSmallRowsMax.
  int row_invariant_rows() const override {
    return model_.lm_head_bf16.empty() ? cpu::kSmallRowsMax : std::numeric_limits<int>::max();
  }

  const Transformer& model() const { return model_; }

 private:
  KVCache& cache(int sequence);
  Transformer model_;
  std::map<int, KVCache> caches_;
  int next_sequence_ = 0;
  ForwardWorkspace workspace_;
  ForwardOutput output_;
  std::vector<float> probs_;
  std::vector<int32_t> order_;
};

}  // namespace dspark
