// DraftSource: where speculative decoding gets its proposals, behind one small
// interface (DESIGN.md §3). The engine tells a source about each request's
// tokens as the target accepts them, and asks it for up to n tokens that
// follow the current `pending` token.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/sampling.h"
#include "model/target.h"

namespace dspark {

struct Proposal {
  std::vector<int32_t> tokens;    // the proposed continuation (may be empty: then the round is a plain step)
  std::vector<float> confidence;  // [n] per-position confidence, where the source has one
  std::vector<float> probs;       // [n, V] the processed distributions the tokens were sampled from;
                                  // empty: the tokens are deterministic (a one-hot q)
};

class DraftSource {
 public:
  virtual ~DraftSource() = default;

  // Target hidden-state taps the source reads (DESIGN §2), or none.
  virtual std::vector<int> tap_layers() const { return {}; }
  // As Target::warm_up_runs: drafting passes so far that ran a shape for its
  // first time (eagerly, then capturing it).
  virtual long warm_up_runs() const { return 0; }

  // A new request in batch slot `row`; `seed` fixes its random stream.
  virtual void begin(int row, std::span<const int32_t> prompt, uint64_t seed) = 0;

  // `tokens` entered the target's KV cache for `row` (the prefill, then each
  // round's pending + accepted drafts); `tapped_rows` [count, m*H] are their
  // tapped hidden rows (null when tap_layers() is empty).
  virtual void accept(int row, std::span<const int32_t> tokens, const float* tapped_rows) = 0;

  // Whether the source can take tapped rows in device memory, straight from
  // the target's TargetResult::device_taps (model/target.h). Sources on the
  // host keep the default: the engine then asks the target for host taps.
  virtual bool accepts_device_taps() const { return false; }
  // accept() with `device_rows` [count, m*H] f32 in device memory, written by
  // the target's last forward and intact for as long as its result says
  // (TargetResult::device_taps_intact): the source must take them before a
  // forward overwrites them (it may queue device work on the target's
  // stream, which orders it before later forwards). Only called when
  // accepts_device_taps().
  virtual void accept_device(int row, std::span<const int32_t> tokens, const float* device_rows);
  // Called after each batch of accepts (the prefill's, then each round's),
  // before the target's next forward, with the result of the forward they
  // came from: a source holding device rows must take, before it returns,
  // those the next forward may overwrite (CudaDSparkSource converts all it
  // holds in one launch then; rows the target keeps in its tap ring wait for
  // the next draft or the ring's turn, so an undrafted round launches nothing).
  virtual void finish_accepts(const TargetResult& /*forward*/) {}

  // Proposals for `rows`, each continuing after its `pending` token (the last
  // emitted token, not yet in the target's cache); at most max_tokens[i] each.
  virtual void propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
                       const cpu::SamplingParams& sampling, std::vector<Proposal>& proposals) = 0;

  virtual void end(int row) = 0;
};

inline void DraftSource::accept_device(int, std::span<const int32_t>, const float*) {
  fail("this draft source does not take tapped rows on the device");
}

// source.accept(_device) for `tokens` of `row` with their tapped rows: rows
// [first_row, first_row + tokens) of `step`'s taps, wherever the forward left
// them (device or host); tap_width (m·H, 0 when the source reads no taps) is
// each row's width.
inline void accept_tapped_rows(DraftSource& source, int row, std::span<const int32_t> tokens,
                               const TargetResult& step, size_t first_row, size_t tap_width) {
  if (tap_width == 0)
    source.accept(row, tokens, nullptr);
  else if (step.device_taps)
    source.accept_device(row, tokens, step.device_taps + first_row * tap_width);
  else
    source.accept(row, tokens, step.taps.data() + first_row * tap_width);
}

}  // namespace dspark
