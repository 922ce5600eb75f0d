// The DSpark training loss and its backward on one NVIDIA GPU: the CUDA
// version of train/loss.h's drafter_loss (same LossTerms, same gradients) for
// a TrainBatch uploaded to the device, with the drafter's f32 master weights
// and gradients resident there.
//
// Precision (CudaTrainPrecision):
//   - Weights, gradients, activations and the AdamW moments are f32.
//   - The drafter's GEMMs multiply f32 operands on the TF32 tensor cores
//     (10-bit mantissa, f32 accumulation; GemmMath::F32 runs them in plain f32
//     for the parity tests). TF32 rather than bf16 operands: every operand is
//     already f32 (master weights, activations kept for the backward), so no
//     shadow bf16 copies are kept in step with AdamW, and TF32 keeps 3 more
//     mantissa bits than bf16 at the same accumulation.
//   - The target's frozen embedding and LM head [V, H], the largest matrices
//     of the step (read three times: the drafter's logits, the target's
//     logits, the logits' gradient), are held in bf16 by default (as the CUDA
//     target holds them) and multiplied as bf16 operands with f32
//     accumulation: half the bytes of the memory-bound head GEMMs. Their
//     inputs (h @ out_proj, the target rows, dLoss/dL) are rounded to bf16.
//   - Every reduction is deterministic (fixed order, no atomics): a step is
//     reproducible bit for bit on the same GPU, so a stopped and resumed run
//     equals a straight one.
//   Against the CPU reference (f32, double in places): plain f32 with an f32
//   head agrees to ~1e-5 relative on the loss terms and every gradient; TF32
//   with a bf16 head to ~1e-2 on the gradients (the bf16 head dominates), see
//   tests/cuda/test_cuda_train.cpp.
//
// Row order: head order throughout, row k·A + a for position k of anchor a
// (the CPU backbone uses a·γ + k; the math is row-wise but for the attention,
// which finds each anchor's rows itself), so one position of every anchor is a
// contiguous [A, ·] slab for the recurrent heads and the block rows.
//
// Shape letters: A anchors, γ block, R = γ·A rows, C context rows of the
// batch, d draft width, F = f·d MLP width, H target hidden, V vocab, m taps,
// W = m·H, r head rank.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/cuda/buffer.h"
#include "kernels/cuda/matmul.h"
#include "spec/draft.h"
#include "spec/drafter.h"
#include "train/batch_pipeline.h"
#include "train/loss.h"
#include "train/train_batch.h"

namespace dspark {

struct CudaTrainPrecision {
  cuda::GemmMath math = cuda::GemmMath::TF32;  // the drafter's own GEMMs
  bool bf16_head = true;                       // the target's embedding and LM head (and their GEMMs) in bf16
};

// The target's frozen embedding and LM head on the device, uploaded once
// (bf16 or f32); a tied head (lm_head == embedding) is stored once. Never
// copied into the drafter.
class CudaTrainHead {
 public:
  CudaTrainHead(const TargetHead& head, const TargetDims& dims, bool use_bf16);
  // Benchmarks: uniform values in [-scale, scale) drawn on the device (untied).
  static CudaTrainHead random(const TargetDims& dims, bool use_bf16, uint64_t seed, float scale);

  const TargetDims& dims() const { return dims_; }
  bool bf16() const { return bf16_; }
  const void* embedding() const;  // [V, H]
  const void* lm_head() const;    // [V, H]

 private:
  CudaTrainHead(const TargetDims& dims, bool use_bf16) : dims_(dims), bf16_(use_bf16) {}
  TargetDims dims_;
  bool bf16_ = true;
  bool tied_ = false;
  cuda::DeviceBuffer<float> embedding_f32_, lm_head_f32_;
  cuda::DeviceBuffer<__nv_bfloat16> embedding_bf16_, lm_head_bf16_;
};

// Where each drafter tensor lives in the flat device arrays of weights,
// gradients and moments: the tensors weight decay applies to first
// (drafter_parameter_decays), then the rest, each at a multiple of 64 floats
// (256 bytes, what cuBLASLt likes); the padding stays 0.
struct CudaParameterLayout {
  struct Entry {
    long offset = 0;
    Shape shape;
    long count = 0;
  };
  std::vector<std::string> names;  // the drafter's order
  std::map<std::string, Entry> entries;
  long total = 0;    // floats, padding included
  long decayed = 0;  // elements [0, decayed) decay

  explicit CudaParameterLayout(const Drafter& drafter);
  // Host tensors (by name, shaped as the drafter's) <-> one flat host array.
  std::vector<float> pack(const std::map<std::string, Tensor>& tensors) const;
  void unpack(const std::vector<float>& flat, std::map<std::string, Tensor>& tensors) const;
};

// How a batch's f32 context rows travel: F32 as they are; Bf16 halves the
// largest transfer of a step and is exact when every value is a bf16 value
// (as regenerated data's are: they are stored in bf16). Rows given in bf16
// (TrainBatch::context_rows_bf16, as the trainer builds them for the GPU)
// travel as they are.
enum class ContextUpload { F32, Bf16 };

class CudaDrafterLoss {
 public:
  // Uploads the drafter's weights; `head` must outlive this.
  CudaDrafterLoss(const Drafter& drafter, const CudaTrainHead& head, const CudaTrainPrecision& precision);
  ~CudaDrafterLoss();
  CudaDrafterLoss(const CudaDrafterLoss&) = delete;
  CudaDrafterLoss& operator=(const CudaDrafterLoss&) = delete;

  const CudaParameterLayout& layout() const { return layout_; }
  cudaStream_t stream() const { return stream_; }
  float* parameters() { return parameters_.data(); }  // [layout().total] device
  float* gradients() { return gradients_.data(); }    // [layout().total] device

  void upload_parameters(const Drafter& drafter);
  void download_parameters(Drafter& drafter) const;  // waits for the stream
  void download_gradients(Gradients& gradients) const;
  void zero_gradients();  // on the stream

  // Checks `batch` (as drafter_loss does) and copies it to the device (asynchronously;
  // the host staging is reused once the previous copy is done), packed as bind() takes it.
  void upload(const TrainBatch& batch, ContextUpload context = ContextUpload::F32);
  // The next launches read `batch` (train/batch_pipeline.h) at `device` ([batch.layout.bytes],
  // written there by the caller: the stream must be made to wait for that copy); launch()
  // writes the position weights into it.
  void bind(const PackedBatch& batch, unsigned char* device);
  // The loss of the uploaded batch, launched on stream(): device_terms() receives
  // {loss, CE, L1, BCE, τ̂, positions} (cuda::kLossTerms doubles); with gradients,
  // dLoss/dθ accumulates (+=) into gradients() (nothing when no position is trained).
  void launch(const LossWeights& weights, bool gradients);
  const double* device_terms() const { return terms_.data(); }
  // launch(), then the terms copied back (waits for the stream).
  LossTerms compute(const LossWeights& weights, bool gradients);
  // LossTerms from the kLossTerms doubles of device_terms().
  static LossTerms terms_from(const double* values);

 private:
  using bf16 = __nv_bfloat16;
  struct Weights;  // device pointers of every tensor, by role
  struct LayerActivations {
    cuda::DeviceBuffer<float> input, normed, q, k, v, context_k, context_v, attention, lse, middle, ff_normed, gate,
        up, gated;
  };
  Weights resolve(float* base) const;
  void forward(const Weights& p);
  void backward(const Weights& p, const Weights& g);
  void gemm_in_out(float* out, const float* x, const float* weight, int rows, int in, int out_features, float beta);
  void gemm_backward_input(float* dx, const float* dout, const float* weight, int rows, int in, int out_features,
                           float beta);
  void gemm_backward_weight(float* dweight, const float* x, const float* dout, int rows, int in, int out_features);
  float* scratch(long floats);

  DrafterConfig config_;
  TargetDims dims_;
  const CudaTrainHead& head_;
  CudaTrainPrecision precision_;
  CudaParameterLayout layout_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t uploaded_ = nullptr;  // the last batch copy out of staging_ is done
  int width_ = 0, inner_ = 0, head_dim_ = 0;
  cuda::DeviceBuffer<float> parameters_, gradients_;

  // The batch the next launch reads: its layout and host-side parts, and its bytes on the device
  // (batch_ for upload(), a pipeline slot for bind()).
  PackedBatch bound_;
  unsigned char* device_batch_ = nullptr;
  cuda::PinnedBuffer<unsigned char> staging_;
  cuda::DeviceBuffer<unsigned char> batch_;
  cuda::PinnedBuffer<float> weights_staging_;  // [R] position weights of the next launch
  cudaEvent_t weights_copied_ = nullptr;

  // Activations and scratch (grow-only).
  cuda::DeviceBuffer<float> context_f32_, context_projected_, context_hidden_, context_normed_;
  cuda::DeviceBuffer<float> anchor_embeddings_, token_, block_, hidden_, head_input_, logits_, target_logits_;
  cuda::DeviceBuffer<bf16> head_input_bf16_, target_rows_bf16_, dlogits_bf16_;
  cuda::DeviceBuffer<float> embedded_, state_, gru_input_, gru_gates_, gru_output_, confidence_, row_terms_;
  std::vector<LayerActivations> layers_;
  cuda::DeviceBuffer<float> dlogits_, dconfidence_, dhidden_, dembedded_, dstate_, dgru_output_, dgru_gates_, dz_,
      dhead_input_, dblock_, dgated_, dgate_, dup_, dnormed_, dattention_, dq_, dk_, dv_, dcontext_k_, dcontext_v_,
      dcontext_normed_, dcontext_hidden_, scratch_;
  cuda::DeviceBuffer<double> terms_;
};

}  // namespace dspark
