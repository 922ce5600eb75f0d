#include "spec/speculative.h"

#include <algorithm>
#include <chrono>
#include <ranges>

#include "core/error.h"
#include "core/random.h"
#include "model/generate.h"
#include "spec/acceptance.h"
#include "spec/scheduler.h"

namespace dspark {

std::vector<double> SpeculativeStats::acceptance_by_position() const {
  std::vector<double> rates;
  for (size_t k = 0; k < drafted_at.size() && drafted_at[k] > 0; ++k)
    rates.push_back(double(accepted_at[k]) / drafted_at[k]);
  return rates;
}

void SpeculativeStats::add(const SpeculativeStats& other) {
  rounds += other.rounds;
  proposed += other.proposed;
  undrafted += other.undrafted;
  drafted += other.drafted;
  accepted += other.accepted;
  drafted_at.resize(std::max(drafted_at.size(), other.drafted_at.size()));
  accepted_at.resize(drafted_at.size());
  for (size_t k = 0; k < other.drafted_at.size(); ++k) {
    drafted_at[k] += other.drafted_at[k];
    accepted_at[k] += other.accepted_at[k];
  }
}

void SpeculativeTiming::add(const SpeculativeTiming& other) {
  prefill_seconds += other.prefill_seconds;
  decode_seconds += other.decode_seconds;
  rounds += other.rounds;
  draft_seconds += other.draft_seconds;
  verify_seconds += other.verify_seconds;
  accept_seconds += other.accept_seconds;
  admission_prefill_seconds += other.admission_prefill_seconds;
  undrafted_rounds += other.undrafted_rounds;
  undrafted_seconds += other.undrafted_seconds;
  full_batch.add(other.full_batch);
  warm_ups.add(other.warm_ups);
}

uint64_t stream_seed(uint64_t seed, int row, int purpose) {
  Rng mixer(seed ^ (0x9e3779b97f4a7c15ull * (uint64_t(row) * 2 + purpose + 1)));
  return mixer.next();
}

namespace {

struct Request {
  int sequence = -1;
  int capacity = 0;
  int32_t pending = 0;
  bool done = false;
  Rng rng{0};
  SpeculativeResult result;
};

}  // namespace

std::vector<SpeculativeResult> speculative_generate(Target& target, DraftSource& source,
                                                    std::span<const std::vector<int32_t>> prompts,
                                                    const SpeculativeOptions& options, SpeculativeTiming* timing) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& config = target.config();
  const int V = config.vocab_size;
  DSPARK_CHECK(options.gamma >= 0, "gamma must not be negative");
  const std::vector<int> taps = source.tap_layers();
  const size_t tap_width = taps.size() * config.hidden_size;
  // Tapped rows stay on the device when the source can read them there (the
  // GPU drafter beside the CUDA target): no copy to the host and back. A
  // target may still answer with host taps (target.h), so each accept follows
  // what the forward returned.
  const bool taps_on_device = !taps.empty() && source.accepts_device_taps();
  TargetResult step;
  auto accept = [&](int slot, std::span<const int32_t> tokens, size_t first_row) {
    accept_tapped_rows(source, slot, tokens, step, first_row, tap_width);
  };
  std::vector<Request> requests(prompts.size());
  for (const std::vector<int32_t>& prompt : prompts) check_prompt_fits(config, prompt.size());
  DSPARK_CHECK(options.max_active >= 0, "max_active must not be negative");
  const size_t most_active = options.max_active > 0 ? size_t(options.max_active) : prompts.size();
  // The requests admitted and not done, in admission order: a round looks at
  // these, not at every request admitted so far (at batch 64 of 160 requests
  // the scan of them all took ~2 us a round, ~1% of the round).
  std::vector<size_t> running;
  const auto start = Clock::now();

  // Admission: every prompt token but the last enters the cache (and the
  // drafter's context) in a prefill forward, the last one being the request's
  // first pending token; it drafts from its first round. Requests are prefilled
  // in groups of max_active, in order (PrefillGroups): the first group at the
  // start, the next one whenever a place frees up and no prefilled request is
  // waiting for one (those that find no place yet wait with their caches kept).
  // One forward a group, not one a request: speculative rows finish one at a
  // time (their acceptance differs), and a prompt carried in a round's verify
  // forward makes that forward run eagerly, a shape no graph has captured (on
  // the H100 at batch 8 such drafted rounds took 0.67 ms against 0.34), where
  // plain decoding's rows finish together and take their prompts 8 at a time.
  // Plain decoding (model/generate.cpp) prefills the same groups, so a prompt's
  // rows go through the same forward in both modes.
  std::vector<TargetInput> inputs;
  std::vector<size_t> owners;
  PrefillGroups groups(prompts.size(), most_active);
  TargetRequest prefill_request;
  prefill_request.taps = taps;
  prefill_request.taps_on_device = taps_on_device;
  auto prefill_group = [&](size_t first, size_t end) {
    inputs.clear();
    owners.clear();
    for (size_t r = first; r < end; ++r) {
      const auto& prompt = prompts[r];
      Request& request = requests[r];
      request.capacity = static_cast<int>(
          std::min<long>(config.max_positions, long(prompt.size()) + options.max_new_tokens + options.gamma + 1));
      request.sequence = target.create_sequence(request.capacity);
      request.pending = prompt.back();
      request.rng = Rng(stream_seed(options.seed, int(r), 0));
      request.result.stop_reason = "length";
      request.result.stats.drafted_at.assign(options.gamma, 0);
      request.result.stats.accepted_at.assign(options.gamma, 0);
      source.begin(int(r), prompt, stream_seed(options.seed, int(r), 1));
      if (prompt.size() > 1) {
        inputs.push_back({request.sequence, std::span(prompt).first(prompt.size() - 1), false});
        owners.push_back(r);
      }
    }
    if (inputs.empty()) return;
    target.forward(inputs, prefill_request, step);
    size_t row = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      accept(int(owners[i]), inputs[i].tokens, row);
      row += inputs[i].tokens.size();
    }
    source.finish_accepts(step);
  };
  auto admit = [&] {
    while (running.size() < most_active) {
      const std::optional<size_t> r = groups.next(prefill_group);
      if (!r) break;
      running.push_back(*r);
    }
  };
  admit();
  const auto prefill_done = Clock::now();
  // Every request done, those a round emitted the last token of and those
  // found at their context's end before one, gives back its cache and its
  // draft state and its place. Whether any did.
  auto retire_done = [&] {
    return std::erase_if(running, [&](size_t r) {
             if (!requests[r].done) return false;
             target.release_sequence(requests[r].sequence);
             source.end(int(r));
             return true;
           }) > 0;
  };

  std::vector<int> active, limits, remaining, verify_counts;
  std::vector<long> proposed_counts;
  std::vector<int32_t> pending;
  std::vector<Proposal> proposals;
  std::vector<std::vector<int32_t>> blocks;
  std::vector<int32_t> emitted;
  std::vector<float> target_probs;
  std::vector<int32_t> order;
  // Shapes run for one of their first times so far (eagerly, or captured), by the target and the source.
  const auto warm_up_runs = [&] { return target.warm_up_runs() + source.warm_up_runs(); };
  while (true) {
    const auto iteration_start = Clock::now();  // (a round runs from here to the next one's start)
    const long iteration_warm_ups = warm_up_runs();
    admit();  // places freed by the last round go to waiting requests
    active.clear();
    limits.clear();
    remaining.clear();
    pending.clear();
    // The newest requests first: where the scheduler lets only some rows
    // draft (a probe), those rows' drafts are the least likely to be cut short
    // by a request's end (the oldest row, often a few tokens from its end
    // under continuous batching, had the gate judge drafting by a draft of
    // one or two).
    for (size_t r : std::views::reverse(running)) {
      Request& request = requests[r];
      if (request.done) continue;
      const int length = target.sequence_length(request.sequence);
      if (length >= config.max_positions) {  // no room left even for the pending token
        request.result.stop_reason = "context";
        request.done = true;
        continue;
      }
      const int left =
          std::min(options.max_new_tokens - int(request.result.tokens.size()), config.max_positions - length);
      active.push_back(int(r));
      pending.push_back(request.pending);
      remaining.push_back(left);
      limits.push_back(std::max(0, std::min(options.gamma, left - 1)));
    }
    if (active.empty()) {  // every running request just stopped at its context's end (or none is left)
      if (!retire_done()) break;
      continue;  // their places go to waiting requests
    }
    const bool full_batch = options.max_active > 0 && active.size() == most_active;  // (SpeculativeTiming)
    long round_tokens = 0;                                                           // emitted this round
    // The scheduler may leave rows undrafted (drafting would not pay): the
    // first `drafting` rows draft, the others take a plain decoding step, their
    // pending token verified alone.
    const RoundOutlook outlook{active, remaining, int(groups.waiting())};
    const size_t drafting = options.scheduler ? size_t(options.scheduler->rows_to_draft(outlook)) : active.size();
    if (options.scheduler && drafting > 0) {  // the scheduler may also draft fewer positions this round
      const int length = std::clamp(options.scheduler->draft_length(options.gamma), 0, options.gamma);
      for (size_t i = 0; i < drafting; ++i) limits[i] = std::min(limits[i], length);
    }
    proposals.clear();
    const long warm_ups = warm_up_runs();
    const auto round_start = Clock::now();
    if (drafting > 0)
      source.propose(std::span(active).first(drafting), std::span(pending).first(drafting),
                     std::span(limits).first(drafting), options.sampling, proposals);
    proposals.resize(active.size());
    proposed_counts.clear();
    for (size_t i = 0; i < active.size(); ++i) {
      Proposal& proposal = proposals[i];
      if (int(proposal.tokens.size()) > limits[i]) proposal.tokens.resize(limits[i]);
      if (proposal.confidence.size() > proposal.tokens.size()) proposal.confidence.resize(proposal.tokens.size());
      if (proposal.probs.size() > proposal.tokens.size() * V) proposal.probs.resize(proposal.tokens.size() * V);
      proposed_counts.push_back(long(proposal.tokens.size()));
    }

    // The scheduler keeps a prefix of each proposal. Cutting AFTER drafting
    // is lossless. The source drew x_0, x_1, ... in order, x_j from q_j(. | x_<j).
    // The scheduler's decision to verify x_j reads only confidences c_{r,i},
    // i <= j, each computed before x_i was drawn (c_i sees x_<i), plus other
    // rows' confidences (independent streams); it never reads x_j or anything
    // drawn after it (Alg 1's early stop guarantees this: a candidate's fate
    // depends only on the candidates walked before it). So, given x_<j and the
    // decision to verify position j, x_j is still distributed as q_j(. | x_<j),
    // and min(1, p/q) acceptance with residual resampling emits p exactly;
    // when position j is cut, the target's own sample of p is emitted there
    // instead, which is also p. Drawing a token and discarding it is the same,
    // in law, as never drawing it: the draft stream is separate from the
    // acceptance stream, so nothing downstream sees the discarded draws.
    // Greedy output is the target's argmax whatever prefix is verified.
    if (options.scheduler && drafting > 0) {
      options.scheduler->schedule(proposals, verify_counts);
      for (size_t i = 0; i < active.size(); ++i) {
        Proposal& proposal = proposals[i];
        const size_t keep = std::min(proposal.tokens.size(), size_t(std::max(0, verify_counts[i])));
        proposal.tokens.resize(keep);
        if (proposal.confidence.size() > keep) proposal.confidence.resize(keep);
        if (!proposal.probs.empty()) proposal.probs.resize(keep * size_t(V));
      }
    }

    // One verify forward: each active request's [pending, drafts...].
    inputs.clear();
    blocks.resize(active.size());  // (their storage kept from round to round: no allocation per row)
    for (size_t i = 0; i < active.size(); ++i) {
      const Proposal& proposal = proposals[i];
      blocks[i].assign(1, pending[i]);
      blocks[i].insert(blocks[i].end(), proposal.tokens.begin(), proposal.tokens.end());
      inputs.push_back({requests[active[i]].sequence, blocks[i], true});
    }
    TargetRequest verify;
    verify.taps = taps;
    verify.taps_on_device = taps_on_device;
    verify.want_logits = !options.sampling.greedy();
    const auto verify_start = Clock::now();
    target.forward(inputs, verify, step);
    const auto verify_done = Clock::now();

    size_t row = 0;  // logit rows, and tapped rows
    for (size_t i = 0; i < active.size(); ++i) {
      Request& request = requests[active[i]];
      const Proposal& proposal = proposals[i];
      const int n = static_cast<int>(proposal.tokens.size());
      Verdict verdict;
      if (options.sampling.greedy()) {
        verdict = accept_greedy(std::span(step.tokens).subspan(row, n + 1), proposal.tokens);
      } else {
        target_probs.resize(size_t(n + 1) * V);
        for (int k = 0; k <= n; ++k)
          cpu::processed_distribution(target_probs.data() + size_t(k) * V, step.logits.data() + (row + k) * V, V,
                                      options.sampling, order);
        verdict = accept_sampled(target_probs, proposal.probs, proposal.tokens, V, request.rng);
      }
      // Keep pending + the accepted drafts in the cache (roll back the
      // rejected ones, where there are any); teach the source the same.
      if (const int rejected = n - verdict.accepted; rejected > 0)
        target.truncate_sequence(request.sequence, target.sequence_length(request.sequence) - rejected);
      accept(active[i], std::span(blocks[i]).first(1 + verdict.accepted), row);
      row += n + 1;

      SpeculativeStats& stats = request.result.stats;
      ++stats.rounds;
      if (i >= drafting) ++stats.undrafted;
      stats.proposed += proposed_counts[i];
      stats.drafted += n;
      stats.accepted += verdict.accepted;
      for (int k = 0; k < n; ++k) ++stats.drafted_at[k];
      for (int k = 0; k < verdict.accepted; ++k) ++stats.accepted_at[k];
      emitted.assign(proposal.tokens.begin(), proposal.tokens.begin() + verdict.accepted);
      emitted.push_back(verdict.next);
      for (size_t e = 0; e < emitted.size(); ++e) {  // stop conditions, token by token
        request.result.tokens.push_back(emitted[e]);
        if (is_eos(config, emitted[e]) && !options.ignore_eos) {
          request.result.stop_reason = "eos";
          request.done = true;
        } else if (int(request.result.tokens.size()) >= options.max_new_tokens) {
          request.done = true;
        }
        if (request.done) {
          emitted.resize(e + 1);
          break;
        }
      }
      round_tokens += long(emitted.size());
      if (options.trace)
        request.result.trace.push_back({proposal.tokens, proposal.confidence, verdict.accepted, emitted});
      request.pending = verdict.next;
    }
    source.finish_accepts(step);  // before the next forward may overwrite the taps
    const bool warming_up = warm_up_runs() != warm_ups;
    // Round times steer the scheduler only at temperature 0: when sampling,
    // its decisions choose which random numbers are drawn, and a seeded run
    // must repeat exactly, which a clock cannot.
    if (options.scheduler && options.sampling.greedy())
      options.scheduler->observe_round(std::chrono::duration<double>(Clock::now() - round_start).count(), warming_up,
                                       round_tokens);
    retire_done();
    if (timing) {
      ++timing->rounds;
      timing->draft_seconds += std::chrono::duration<double>(verify_start - round_start).count();
      timing->verify_seconds += std::chrono::duration<double>(verify_done - verify_start).count();
      const auto round_done = Clock::now();
      timing->accept_seconds += std::chrono::duration<double>(round_done - verify_done).count();
      if (drafting == 0) {
        ++timing->undrafted_rounds;
        timing->undrafted_seconds += std::chrono::duration<double>(round_done - round_start).count();
      }
      const double iteration_seconds = std::chrono::duration<double>(round_done - iteration_start).count();
      if (full_batch) timing->full_batch.add_step(iteration_seconds, round_tokens);
      // (A prefill before the round counts: it is in the round's time.)
      if (warm_up_runs() != iteration_warm_ups) timing->warm_ups.add_step(iteration_seconds, round_tokens);
    }
  }
  if (timing) {
    timing->prefill_seconds = std::chrono::duration<double>(prefill_done - start).count();
    timing->decode_seconds = std::chrono::duration<double>(Clock::now() - prefill_done).count();
    timing->admission_prefill_seconds = groups.later_prefill_seconds();
  }
  std::vector<SpeculativeResult> results;
  for (Request& request : requests) results.push_back(std::move(request.result));
  return results;
}

}  // namespace dspark
