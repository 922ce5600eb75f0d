// How many of each row's drafted tokens one verify forward checks
// (DESIGN.md §5). The draft source proposes up to γ tokens per row with their
// (calibrated) confidences; a VerifyScheduler then keeps a prefix of each.
//
// PrefixScheduler is the paper's hardware-aware prefix scheduler (Alg 1) for
// a batch of R rows. With SPS(B) the target's verify steps per second at B
// tokens in one forward and a_{r,j} = Π_{i≤j} c_{r,i} the predicted survival
// of row r's draft prefix through position j, it starts from B = R (every
// row's pending token) and τ* = R (every row emits at least one token), walks
// the draft positions in descending a_{r,j}, and admits each one (B += 1,
// τ* += a_{r,j}) while that raises τ*·SPS(B), the expected tokens per second;
// at the first admission that does not, it STOPS. It never skips a position
// and goes on: whether position j of a row is verified then depends only on
// candidates that come before it in the walk, and those carry confidences
// computed before token j was drawn (a_{r,j'} for j' ≤ j reads tokens < j;
// later positions of the row come after it, other rows are independent).
// That is what keeps sampling lossless (spec/speculative.cpp has the whole
// argument); tests/test_speculative.cpp shows a variant without the early
// stop biasing the output.
//
// Alg 1 decides what a round verifies once the drafts exist; their cost is
// spent by then. Whether a round should draft at all is the question before
// it: where the drafter's own time per round, D(R), outweighs what verifying
// drafts gains (a fast target at a large batch), plain decoding steps are
// faster. With a measured D(R), PrefixScheduler keeps a running estimate of
// the gain of the rounds it scheduled, the predicted tokens per second
// R·τ_b/(1/SPS(B) + D(R)) of a round where all R rows draft over plain
// decoding's measured R·P(R), smoothed by eighths (one round's confidences
// are noisy: smoothed by halves, two poor rounds in a row shut a gate that
// pays 1.3x on average; by quarters, on the H100, hard rounds shut it for
// 40-48% of the rounds at batch 1 and 59-64% at batch 2: 1.26-1.32x and
// 1.13-1.15x where drafting every round ran 1.32-1.37x and 1.17-1.25x; by
// eighths, 7-17% and none: 1.33-1.35x and 1.20-1.25x; by sixteenths, batch 8,
// where drafting loses, drafted for too long), and while it is below 1
// leaves rounds undrafted (plain steps: each row's pending token alone). Then one row drafts, to
// look again (a probe), after 1, 2, 4, ... 512 plain rounds (32 at one row;
// 128 where the estimate is a near miss, 0.9 or more: under continuous
// batching the rows are other requests some rounds later, and at R > 1 a
// probe costs about a plain step, so one in 128 rounds costs under 1%;
// with one in 64, batch 8 on the H100, where drafting loses, ran 2-5%
// below the gate that looked after up to 512). At R > 1
// the probe's drafts are not verified: the round stays a plain step, whose
// shape the CUDA target has captured (whole drafted rounds as probes cost
// 12-34% of the time at batch 16 and 64 on the H100: their new shapes ran
// eagerly and were captured). For the estimate its row stands for all R:
// Alg 1 schedules R copies of its confidences.
// Each batch size (R rounded up to a power of two) has a gate of its own, its
// estimate and its run of plain rounds: a batch that comes back to a size (the
// next static batch after one's tail, a server's batch refilled) resumes it,
// and a size not seen before starts from the estimate of the one the batch came
// from and looks at once (with one gate whose runs started over whenever the
// batch crossed a power of two, each tail of a batch did: in a
// continuous-batching sweep on the CPU, batch 8 spent 3.4% of its time on
// probes, 0.4% with a gate per size). A batch that drains (no request waiting:
// the tail of a server's queue, a static batch) and one that waiting requests
// refill are judged apart, the first by its slowest row's pace, so each has its
// own gate per size: on the H100 at batch 4 the tails' three-row rounds
// (0.8-1.0) shut the gate that the next wave of requests, refilling four rows,
// then met shut.
//
// The profiles are measured once, apart from real rounds; real rounds may
// cost more (a round whose rows verify different numbers of drafts cannot
// replay a captured graph: at batch 64 on the H200 1.3 ms against the
// profile's ~0.5). So the gate also times the rounds it runs: the ratio of a
// drafted round's measured time to the profiles' prediction for it, and of an
// undrafted round's to a plain step's, each the median of its last five
// once there are three, scale the estimate of later rounds (observe_round).
// A round that ran a shape for one of its first times (the CUDA target runs
// a step's shape eagerly once, then captures it: 2-3x and ~10x a replayed
// step; the drafter does both in one pass) is not timed: it is paid once
// per shape, and on the H100 at batch 4 early clusters of such rounds shut
// a gate that pays 1.1x. Nor is one over 4x its prediction. A median, not a
// running mean: a shut gate times no drafted round and an open one no
// undrafted round, so the ratio a gate changed with stays, and with a mean
// one slow round kept a gate that pays shut, or one that does not pay open
// (on the H100 at batch 8 the first undrafted round, at 1.5x, held the gate
// open). Only at temperature 0 (spec/speculative.cpp): a sampling run with a
// seed must repeat exactly. DSPARK_GATE_LOG=1 prints each estimate and
// each timed round on stderr.
//
// The rates delivered. The estimate is a model and can miss by more than
// drafting gains: on the H100 at batch 8 it predicted 1.1-1.4x where drafting
// every round delivered 0.87-1.0x (rounds it does not time, and the
// confidences' optimism); a gate that follows it there drafts some rounds and
// not others, and pays each reopening's catch-up. So where rounds report the
// tokens they emitted (greedy runs), each gate also sums what its rounds of
// each kind delivered, tokens and seconds, decaying by 1/512 a row: drafted
// rounds where every row drafts, after such a round (the first after undrafted
// ones also projects the rows those staged: a cost of switching, not of
// drafting), and undrafted rounds that are not probes; warm-ups not. Once both
// kinds are known (12 rounds; drafted ones also 64 rows: at one row one
// request's poor drafts would otherwise speak for the next ones), the kind with
// the higher rate runs, and the other runs 16 rounds in a row (a trial) once it
// has not run for 16 x 128 x |1 - the rates' ratio| rounds (256 to 2048: a
// trial costs about 1/128 of the time), so that a gate keeps measuring what it
// does not use (a factor learned only from the rounds a gate runs keeps the
// gate where it shut it). Drafting is first measured where the estimate drafts
// (a trial of drafting where nothing is known cost a batch of 32 on the H100
// 0.44x: every drafted shape was new there), and later trials of drafting need
// the estimate at a near miss or better; where it is lower, a probe runs in the
// trial's place and brings it up to date. 16 undrafted rounds are tried as soon
// as drafted ones are known, unless those deliver over 1/0.9 of what undrafted
// ones can (R tokens a plain step, as predicted: a real one also pays its
// admissions); then the periodic trial is their first. The rates count every
// cost, those the estimate models and those it does not, on this machine and
// this traffic; the estimate still prices each round's positions (Alg 1 and
// the draft length) and decides where no tokens are reported (sampling).
//
// τ_b is the batch's progress per round. Row r drafting is expected to emit
// e_r tokens a round (1 + the survival of its verified prefix). While
// requests wait for a place (continuous batching) a row that finishes is
// replaced at once, so the batch progresses by its rows' total: τ_b = Σ_r
// e_r. Otherwise the rows of a batch run until the last of them is done: with
// n_r tokens left, drafting needs max_r n_r / e_r rounds where plain decoding
// needs max_r n_r steps, τ_b = max_r n_r / max_r (n_r / e_r), over the rows
// that drafted. One slow row holds the whole batch (measured on the H200 at
// batch 64: rounds emitting 2.7 tokens per row on average finished the batch
// in 121 rounds where plain decoding took 192 steps, a τ_b of 1.6). Each
// row's e_r is smoothed over the rounds it drafts: the max over rows of one
// round's noisy n_r / e_r sits above the batch's real pace (at two rows on
// the H200 the gate shut rounds where drafting every round gained 3-11%).
//
// The decisions read only earlier rounds' confidences (and, greedy, their
// durations), the rows' remaining lengths and the stored profiles, never a
// token of the round they concern, so every output distribution (and, given
// the cached profiles, every output) stays as it was.
#pragma once
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/json.h"
#include "model/target.h"
#include "spec/draft_source.h"

namespace dspark {

// SPS(B): measured verify steps per second at B tokens per forward.
struct SpsProfile {
  std::vector<int> tokens;               // B of each measurement, ascending, tokens[0] = 1
  std::vector<double> steps_per_second;  // [points] SPS(B)
  // Plain decoding's steps per second at R sequences of one token each, no
  // taps: what a round left undrafted competes with (the verify profile above
  // spreads B over B/8 sequences and returns taps, which costs more per token).
  std::vector<int> plain_rows = {};                 // R of each measurement, ascending, or empty
  std::vector<double> plain_steps_per_second = {};  // [plain points]
  // Verify forwards as a round runs them: R sequences (plain_rows) of 1 + k
  // tokens each (k in round_drafts; for k > 0 one of them one token short, as
  // Alg 1's rows differ), with the taps: what a round whose rows verify k
  // drafts on average costs (SPS(B) alone cannot tell 64 rows with one draft
  // each from 8 rows with 8).
  std::vector<int> round_drafts = {};                // k of each measurement, ascending from 0, or empty
  std::vector<double> round_steps_per_second = {};   // [plain points, round_drafts]
  // SPS at any B >= 1: the step time 1/SPS is interpolated linearly between
  // measured points and extrapolated linearly (never decreasing) past the last.
  double at(int tokens) const;
  // Plain steps per second at R rows, interpolated the same way (at(R) when not measured).
  double plain_at(int rows) const;
  // Verify steps per second of a round of R rows with k drafts each on
  // average (step time linear in k between measured k, then in R as at());
  // at(R * (1 + k)) when not measured.
  double round_at(int rows, double drafts_per_row) const;
  Json to_json() const;
  static SpsProfile from_json(const Json& json, const std::string& where);
};

// D(R, L): seconds a round of R rows spends drafting L positions each, the
// drafter's context extension by the previous round's rows included.
struct DraftCostProfile {
  std::vector<int> rows;        // R of each measurement, ascending, rows[0] = 1
  std::vector<double> seconds;  // [points, lengths] one propose() for R rows of L positions
  // L of each measurement, ascending, the last one γ; empty: only γ was
  // measured (seconds is then [points]).
  std::vector<int> lengths = {};
  // D at any R >= 1: linear in L between measured lengths (clamped to them),
  // then interpolated linearly between measured R, the last measurement's
  // cost per row beyond it. at(R) drafts γ positions.
  double at(int rows, int length) const;
  double at(int rows) const { return at(rows, lengths.empty() ? 1 : lengths.back()); }
  Json to_json() const;
  static DraftCostProfile from_json(const Json& json, const std::string& where);
};

struct SpsProfileOptions {
  int max_tokens = 512;         // the largest B measured
  int context = 64;             // tokens already in each sequence's cache
  int tokens_per_sequence = 8;  // B is spread over ceil(B / this) sequences, like verify blocks
  std::vector<int> taps;        // tapped layers returned with the forward, as the draft source needs
  bool taps_on_device = false;  // ... left on the device, as a GPU drafter reads them
  int max_rows = 0;             // plain steps measured up to this many sequences (0: as many as the B points use)
  int max_drafts = 7;           // round forwards measured with up to this many drafts per row
  int runs = 5;                 // timed runs per point (median), after 2 warm-ups
};

// The B values measured: 1, 2, 3, 4, 6, 8, 12, ... (powers of 2 and 1.5x
// between) up to max_tokens, which is always included.
std::vector<int> sps_profile_points(int max_tokens);

// Times greedy verify forwards of B tokens on `target` (rolled back after
// each), then plain decoding steps of R = 1, 2, 4, ... sequences (one token
// each, no taps). Step times are made non-decreasing in B and R (more tokens
// never cost less; what remains is timing noise).
SpsProfile measure_sps(Target& target, const SpsProfileOptions& options);

// The cache of measured profiles: $DSPARK_CACHE_DIR/sps.json, else
// $XDG_CACHE_HOME/dspark/sps.json, else ~/.cache/dspark/sps.json.
std::filesystem::path default_sps_cache_path();

// The profile of this target (device description + `model_key` + the
// options' context, spread and taps) from `cache_file`, measured and stored
// (atomically, other entries kept) when absent, when it stops short of
// max_tokens, or when `remeasure`. An unreadable cache file is replaced.
SpsProfile cached_sps_profile(Target& target, const std::string& model_key, const SpsProfileOptions& options,
                              const std::filesystem::path& cache_file, bool remeasure = false,
                              bool* measured = nullptr);

// Times what drafting adds to a round of R = 1, 2, 4, ... max_rows rows,
// beside its verify forward: the round's accepted rows entering the source's
// context (3 per row, with their taps: the drafter projects them before it
// drafts) and DraftSource::propose of `gamma` positions each (greedy, every
// position drafted); then, for the shorter lengths L in sps_profile_points(γ),
// what proposing L positions instead saves. Each row starts from a random
// context of `context` tokens that `target` prefilled with the source's taps.
DraftCostProfile measure_draft_cost(Target& target, DraftSource& source, int gamma, int max_rows, int context = 64,
                                    int runs = 5);

// The profile for `draft_key` (the drafter, its γ and the target) from
// `cache_file`, as cached_sps_profile does.
DraftCostProfile cached_draft_cost(Target& target, DraftSource& source, const std::string& draft_key, int gamma,
                                   int max_rows, const std::filesystem::path& cache_file, bool remeasure = false);

// What the engine tells a scheduler before a round of R rows (the requests
// that may draft).
struct RoundOutlook {
  std::span<const int> rows;       // [R] each row's request: the same id for as long as the request runs
  std::span<const int> remaining;  // [R] the most tokens each row may still emit
  // Requests waiting for a place (continuous batching): while any wait, a
  // row that finishes is replaced at once, so the batch's throughput is its
  // rows' total progress; with none, the batch runs until its last row is done.
  int waiting = 0;
};

class VerifyScheduler {
 public:
  virtual ~VerifyScheduler() = default;
  // Asked before each round: how many of the outlook's rows (the first ones:
  // the engine lists the newest requests first) draft; the others take a
  // plain decoding step (their pending token alone). With 0, schedule() is
  // not called. Must not depend on anything drawn in that round.
  virtual int rows_to_draft(const RoundOutlook& outlook) { return static_cast<int>(outlook.remaining.size()); }
  // Asked after rows_to_draft(), when some rows draft: the most positions
  // each of them drafts this round, at most `gamma` (a shorter draft costs
  // less; each row's own limit still applies). Must not depend on anything
  // drawn in that round.
  virtual int draft_length(int gamma) { return gamma; }
  // verify[i] = how many of proposals[i].tokens the round verifies (a prefix).
  // proposals[i].confidence is empty when the source has no confidences.
  virtual void schedule(std::span<const Proposal> proposals, std::vector<int>& verify) = 0;
  // Told after each round how long it took (drafting, verify and accepts, on
  // the host's clock), whether it ran a shape for one of its first times
  // (warm_up_runs of the target or the source moved: a cost paid once), and
  // how many tokens its rows emitted (-1: not counted). Later rounds may read
  // them: they come from rounds already verified, never from the round a
  // decision concerns.
  virtual void observe_round(double /*seconds*/, bool /*warming_up*/ = false, long /*tokens*/ = -1) {}
};

// What Alg 1 weighs a round's tokens against (prefix_schedule). Left as
// they are, τ*·SPS(B): the verify forward's throughput, as the paper has it.
struct RoundPricing {
  // D(R), the round's drafting: spent when the round is scheduled, but part
  // of its time, so the walk weighs τ* / (D + 1/SPS(B)), the round's tokens
  // per second. Alone, the forward's throughput undervalues a draft whose
  // verify costs little beside the drafting already paid for (the demo pair
  // on the H100 at batch 1: 3-4 drafts verified a round against 6.7 when all
  // are, 1.35x against 1.39x).
  double draft_seconds = 0.0;
  // The target runs every row of a verify forward as long as the longest
  // (the CUDA target's captured shapes pad them): a round of R rows whose
  // longest verifies L drafts costs 1/SPS.round_at(R, L) however short the
  // others are. The walk's candidates are then the levels: level j, every
  // row's position j, costs a level of R rows and brings Σ_r a_{r,j}; the
  // levels are admitted in order (their survivals descend) while the round's
  // rate rises, and every row verifies up to L of its drafts (B = R (1 + L)).
  bool padded_rows = false;
};

// Alg 1 on plain confidences: confidences[r] = row r's c_{r,0..n_r-1}
// (values outside [0, 1] are clamped). Returns each row's verified prefix
// length. `extra_tokens`: tokens in the forward beyond the R pending ones and
// the candidates (rows verified whole because they have no confidences).
// `forward_tokens` (when given) receives B of the schedule.
// With padded rows, walking levels is lossless too: whether level j is
// verified depends on a_{r',j'} for j' <= j of every row, so for row r only on
// confidences computed before x_{r,j} was drawn (c_{r,j} reads tokens < j),
// and on other rows' independent draws; a level past the first that does
// not pay is never looked at.
std::vector<int> prefix_schedule(std::span<const std::vector<float>> confidences, const SpsProfile& sps,
                                 int extra_tokens = 0, int* forward_tokens = nullptr, const RoundPricing& pricing = {});

class PrefixScheduler final : public VerifyScheduler {
 public:
  // Without a draft cost profile every round drafts (Alg 1 alone); with one,
  // Alg 1 also weighs the drafting (RoundPricing::draft_seconds).
  // padded_rows: the target's (Target::pads_verify_rows).
  explicit PrefixScheduler(SpsProfile sps, std::optional<DraftCostProfile> draft_cost = std::nullopt,
                           bool padded_rows = false)
      : sps_(std::move(sps)), draft_cost_(std::move(draft_cost)), padded_rows_(padded_rows) {}
  int rows_to_draft(const RoundOutlook& outlook) override;
  // With a draft cost profile measured at several lengths, the L that
  // maximises the round's predicted tokens per second R (1 + Σ_{j<L} ā_j) /
  // (D(R, L) + verify(R, L)), ā_j the survival of position j averaged over the
  // rows of earlier rounds (smoothed); every kFullDraftEvery-th drafted round
  // drafts γ, the only rounds that see the positions past a shorter length.
  int draft_length(int gamma) override;
  // Rows whose proposal has no confidences are verified whole (their tokens count in B).
  void schedule(std::span<const Proposal> proposals, std::vector<int>& verify) override;
  void observe_round(double seconds, bool warming_up = false, long tokens = -1) override;
  const SpsProfile& sps() const { return sps_; }
  // The running estimate of drafting's gain over plain decoding (1 before any round).
  double gain() const { return gate_ ? gate_->gain.value : 1.0; }

 private:
  SpsProfile sps_;
  std::optional<DraftCostProfile> draft_cost_;
  bool padded_rows_ = false;
  std::vector<std::vector<float>> confidences_;
  std::vector<std::vector<float>> copies_;  // a probe's confidences, once for each row
  std::vector<std::vector<double>> survivals_;  // [R] the round's a_{r,j} (schedule(); storage kept)
  std::vector<int> rows_, remaining_;  // the round's outlook (rows_to_draft())
  int waiting_ = 0;
  struct RowPace {
    int remaining;    // the row's remaining length when it last drafted
    double expected;  // its e_r, smoothed over the rounds it drafted
  };
  std::unordered_map<int, RowPace> paces_;  // by request id
  // A ratio smoothed over its measurements, each moving it `weight` of the
  // way (1 before any; the first sets it).
  struct SmoothedRatio {
    double value = 1.0;
    bool measured = false;
    void add(double ratio, double weight = 0.5);
  };
  // Tokens emitted and seconds taken by one kind of round, sums that decay
  // by 1/kDeliveredMemory a row (the scheduler's constant).
  struct Delivered {
    double tokens = 0.0, seconds = 0.0, rows = 0.0;
    long count = 0;       // rounds added
    long last_round = 0;  // the gate's round count at the last (Gate::rounds)
    void add(long round_tokens, double round_seconds, int round_rows, long round);
    double rate() const { return tokens / seconds; }
  };
  // A cost ratio: the median of its last kRecent measurements, 1 before
  // kTrusted of them (a kind of round's first runs replay no graph yet).
  struct RecentMedian {
    static constexpr int kRecent = 5, kTrusted = 3;
    double recent[kRecent] = {};
    int count = 0;  // measurements so far
    double value = 1.0;
    void add(double ratio);
  };
  // The gate at one batch size (the batch's rows rounded up to a power of
  // two): drafting pays differently at each, and a batch that comes back to
  // a size (the next static batch after a tail, a server's batch refilled)
  // resumes where it was, its runs of plain rounds included.
  struct Gate {
    SmoothedRatio gain;      // predicted speculative / plain tokens per second (< 1: plain rounds and probes)
    int undrafted_left = 0;  // plain rounds still to run before the next probe
    int backoff = 1;         // plain rounds after the next round that does not pay
    // Static batches: the slowest row's pace over the rows' mean pace in
    // rounds where every row drafted, smoothed.
    SmoothedRatio slowest_share;
    // What its rounds delivered, once rounds report their tokens (scheduler.h:
    // the rates delivered); a trial runs the kind of round not in use.
    Delivered drafted, undrafted;
    long rounds = 0;            // rounds decided while rounds report their tokens
    int trial_left = 0;         // rounds of the trial still to run
    bool trial_drafts = false;  // whether the trial's rounds draft
    long last_trial = 0;        // the round the last trial (or a probe in its place) started
  };
  // By power of two, and whether the batch drains (no request waits for a place).
  std::map<std::pair<int, bool>, Gate> gates_;
  std::pair<int, bool> gate_key_;  // this round's
  Gate* gate_ = nullptr;           // and its gate
  void enter_gate(int rows);       // sets gate_key_ and gate_ for a batch of `rows` (after waiting_)
  // How many of this round's `rows` draft (all, none, or a probe's one)
  // where the gate's delivered rates or a trial decide; nothing where its
  // estimate does.
  std::optional<int> delivered_decision(int rows);
  bool counts_tokens_ = false;      // rounds report their tokens (greedy: observe_round)
  Delivered* delivered_ = nullptr;  // what the round being run counts to (null: nothing)
  bool all_drafted_ = false;        // every row of the round being run drafts
  double slowest_share() const;
  double round_draft_seconds(int rows) const;   // D(R, L) at this round's draft length
  double undrafted_tokens_per_second(int rows) const;  // R tokens a plain step, scaled by timed undrafted rounds
  RecentMedian drafted_cost_, undrafted_cost_;  // measured / predicted time of a drafted / an undrafted round
  RecentMedian* timed_ = nullptr;               // what the round being run is timed against (null: it is not)
  double predicted_seconds_ = 0.0;              // the profiles' time for it
  bool probing_ = false;            // this round is a probe (one of R > 1 rows drafts while the gate is shut)
  bool drafting_round_ = false, after_drafted_round_ = false;  // this round drafts; the one before did
  std::vector<SmoothedRatio> survival_;  // [γ] ā_j: position j's survival a_{r,j}, the mean over a round's rows
  int draft_length_ = 0;                 // this round's L (0: every position the rows may draft)
  long drafted_rounds_ = 0;              // draft_length() calls with the survivals known
};

}  // namespace dspark
