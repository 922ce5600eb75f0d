// Target: the target model on some device, behind one interface, so that
// generation, perplexity, benchmarks and (later) speculative decoding are
// written once. A target owns its weights and the KV caches of the sequences
// it runs; callers name sequences by id.
//
// One forward() appends each input's tokens to its sequence and returns, for
// every output row (each input's last token, or all of its tokens), the next
// token: the argmax at temperature 0, else the token the processed
// distribution puts at the caller's uniform. Logits stay on the device unless
// asked for; this is what lets the CUDA target run a decode step with a single
// device-to-host copy of token ids.
//
// Tapped hidden rows: a request may ask for them to stay on the device
// (taps_on_device). A target that can (the CUDA target) then returns a view of
// its own device buffer in TargetResult::device_taps and leaves `taps` empty;
// any other target, or a forward it cannot serve that way (the CUDA target's
// chunked long prefill), returns host `taps` as usual and a null view. Callers
// that ask must therefore handle both.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/sampling.h"
#include "model/config.h"

namespace dspark {

struct TargetInput {
  int sequence;                       // id from create_sequence()
  std::span<const int32_t> tokens;    // appended at positions length() ...
  bool all_rows = false;              // an output row per token, else only the last
};

struct TargetRequest {
  cpu::SamplingParams sampling;           // how to pick each row's token (greedy at T = 0)
  std::span<const double> uniforms;       // [R] one uniform in [0,1) per output row when sampling
  std::span<const int32_t> score_tokens;  // [R] when set: nll[row] = -log softmax(logits[row])[token]
  std::span<const int> taps;              // tap indices (0..L) whose rows to return
  bool want_logits = false;               // copy the [R, V] logits to the host
  bool taps_on_device = false;            // leave the tapped rows on the device where the target can
};

struct TargetResult {
  std::vector<int32_t> tokens;  // [R]
  std::vector<float> nll;       // [R] when score_tokens was set
  std::vector<float> logits;    // [R, V] when want_logits
  std::vector<float> taps;      // [T, m, H] when taps were requested (and not left on the device)
  // [T, m, H] f32 in device memory, the same rows as `taps` (every input
  // token, in input order), when taps_on_device was asked and honoured; else
  // null. Not owned: the target's buffer, valid for as long as
  // device_taps_intact says (truncate_sequence and release_sequence leave it
  // alone). The rows are
  // complete when forward() returns and are written on the target's stream
  // (CudaTargetHead::stream), so work queued on that stream afterwards reads
  // them in order, and later forwards on it overwrite them only after that work.
  const float* device_taps = nullptr;
  // How long device_taps stay: 0, until the target's next forward; n > 0,
  // through its next n forwards that keep their taps so. Those forwards are
  // numbered by device_taps_serial (one more each), so that a caller holding
  // rows of several can tell when the oldest must be taken: rows of serial s
  // are overwritten by the forward of serial s + n + 1.
  long device_taps_serial = 0;
  int device_taps_intact = 0;
};

class Target {
 public:
  virtual ~Target() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::string device_description() const = 0;

  // A new empty sequence with room for `capacity` positions.
  virtual int create_sequence(int capacity) = 0;
  virtual void release_sequence(int sequence) = 0;
  virtual int sequence_length(int sequence) const = 0;
  // Rolls the sequence's KV cache back to `length` positions.
  virtual void truncate_sequence(int sequence, int length) = 0;

  virtual void forward(std::span<const TargetInput> inputs, const TargetRequest& request,
                       TargetResult& result) = 0;

  // Up to this many rows in one forward, a row's results do not depend on how
  // many rows share the forward (every kernel sums a row in one fixed order):
  // a verify row then equals the same token decoded alone, and greedy
  // speculative output is plain output bit for bit.
  virtual int row_invariant_rows() const = 0;

  // Whether a forward of several sequences runs each as many rows as the
  // longest (the CUDA target's captured steps): a verify then costs what its
  // longest block does, however short the others (spec/scheduler.h,
  // RoundPricing::padded_rows).
  virtual bool pads_verify_rows() const { return false; }

  // Forwards so far that ran a step's shape for one of its first times
  // (eagerly, or capturing it as a CUDA graph): work paid once per shape,
  // which timing a round to predict later ones should leave out.
  virtual long warm_up_runs() const { return 0; }
};

// "cpu", "cuda", or "auto" (cuda when a GPU is present and the build has CUDA).
std::unique_ptr<Target> load_target(const std::filesystem::path& model_directory,
                                    const std::string& device);

// What "auto" resolves to on this machine.
std::string default_device();

// A --device value with "auto" resolved ("cpu", "cuda", or as given).
std::string resolve_device(const std::string& device);

}  // namespace dspark
