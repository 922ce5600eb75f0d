// The hardware-aware prefix scheduler (Alg 1): SPS interpolation, the walk in
// descending survival with its early stop (hand-computed cases), rows without
// confidences, and the measured SPS profile with its cache file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>

#include "cli_runner.h"
#include "core/file.h"
#include "golden.h"
#include "model/cpu_target.h"
#include "random_drafter.h"
#include "spec/draft.h"
#include "spec/drafter.h"
#include "spec/dspark_source.h"
#include "spec/scheduler.h"

namespace dspark {
namespace {

using testing::TemporaryDirectory;

// The gate's smoothing: each round's estimate moves its gain an eighth of the way.
constexpr double kMove = 1.0 / 8, kStay = 1 - kMove;

// A profile from (B, SPS) pairs.
SpsProfile profile(std::vector<int> tokens, std::vector<double> rates) { return {std::move(tokens), std::move(rates)}; }

// A round's outlook (rows_to_draft's argument) for requests 0..R-1 with these
// remaining lengths and `waiting` requests waiting for a place.
struct Outlook {
  std::vector<int> rows, remaining;
  int waiting = 0;
  explicit Outlook(std::vector<int> remaining_lengths, int waiting_requests = 0)
      : rows(remaining_lengths.size()), remaining(std::move(remaining_lengths)), waiting(waiting_requests) {
    for (size_t r = 0; r < rows.size(); ++r) rows[r] = int(r);
  }
  operator RoundOutlook() const { return {rows, remaining, waiting}; }
};

TEST(SpsProfile, InterpolatesStepTimeAndExtrapolatesPastTheLastPoint) {
  // Step times 10 ms at B = 1, 20 ms at B = 5, 30 ms at B = 9.
  const SpsProfile sps = profile({1, 5, 9}, {100.0, 50.0, 1000.0 / 30});
  EXPECT_DOUBLE_EQ(sps.at(1), 100.0);
  EXPECT_DOUBLE_EQ(sps.at(0), 100.0);           // below the first point: the first
  EXPECT_NEAR(sps.at(3), 1000.0 / 15, 1e-9);    // halfway: 15 ms
  EXPECT_NEAR(sps.at(8), 1000.0 / 27.5, 1e-9);  // 20 + 3/4 * 10 ms
  EXPECT_NEAR(sps.at(13), 1000.0 / 40, 1e-9);   // past the end: 2.5 ms more per token
  const SpsProfile flat_end = profile({1, 4}, {100.0, 100.0});
  EXPECT_DOUBLE_EQ(flat_end.at(100), 100.0);
  const SpsProfile round_trip = SpsProfile::from_json(sps.to_json(), "test");
  EXPECT_EQ(round_trip.tokens, sps.tokens);
  EXPECT_EQ(round_trip.steps_per_second, sps.steps_per_second);
  // Plain decoding's own rates when measured, else the verify profile's.
  EXPECT_DOUBLE_EQ(sps.plain_at(5), sps.at(5));
  SpsProfile with_plain = sps;
  with_plain.plain_rows = {1, 3}, with_plain.plain_steps_per_second = {200.0, 100.0};
  EXPECT_NEAR(with_plain.plain_at(2), 1000.0 / 7.5, 1e-9);  // between 5 and 10 ms
  EXPECT_NEAR(with_plain.plain_at(4), 1000.0 / 12.5, 1e-9);  // 2.5 ms more per row past the end
  // Rounds: at R = 1 step times 10 / 20 ms at k = 0 / 2 drafts; at R = 3, 20 / 40 ms.
  EXPECT_DOUBLE_EQ(with_plain.round_at(1, 1.0), with_plain.at(2));  // not measured: SPS(R (1 + k))
  with_plain.round_drafts = {0, 2}, with_plain.round_steps_per_second = {100.0, 50.0, 50.0, 25.0};
  EXPECT_NEAR(with_plain.round_at(1, 1.0), 1000.0 / 15, 1e-9);
  EXPECT_NEAR(with_plain.round_at(2, 1.0), 1000.0 / 22.5, 1e-9);  // 15 and 30 ms at R = 1 and 3
  EXPECT_NEAR(with_plain.round_at(3, 5.0), 25.0, 1e-9);           // k past the last measured: clamped
  const SpsProfile plain_trip = SpsProfile::from_json(with_plain.to_json(), "test");
  EXPECT_EQ(plain_trip.round_drafts, with_plain.round_drafts);
  EXPECT_EQ(plain_trip.round_steps_per_second, with_plain.round_steps_per_second);
  EXPECT_EQ(plain_trip.plain_rows, with_plain.plain_rows);
  EXPECT_EQ(plain_trip.plain_steps_per_second, with_plain.plain_steps_per_second);
  EXPECT_NE(testing::error_of([] {
              SpsProfile::from_json(Json{{"tokens", {1, 1}}, {"steps_per_second", {1, 1}}}, "x");
            }).find("ascending"),
            std::string::npos);
}

TEST(SpsProfile, PointsCoverPowersOfTwoAndTheirMidpoints) {
  EXPECT_EQ(sps_profile_points(64), (std::vector<int>{1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64}));
  EXPECT_EQ(sps_profile_points(100), (std::vector<int>{1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100}));
  EXPECT_EQ(sps_profile_points(1), (std::vector<int>{1}));
}

TEST(PrefixSchedule, AdmitsInDescendingSurvivalWhileThroughputRises) {
  // Survival: row 0 {0.9, 0.45}, row 1 {0.6}. Walk 0.9, 0.6, 0.45 from B = 2, τ* = 2 (rate 200):
  // 2.9 x SPS(3) = 261 > 200; 3.5 x SPS(4) = 262.5 > 261; 3.95 x SPS(5) = 276.5 > 262.5: all in.
  const std::vector<std::vector<float>> confidences = {{0.9f, 0.5f}, {0.6f}};
  EXPECT_EQ(prefix_schedule(confidences, profile({2, 3, 4, 5}, {100, 90, 75, 70})), (std::vector<int>{2, 1}));
  // SPS(5) = 66: 3.95 x 66 = 260.7 < 262.5, so the third admission stops the walk.
  EXPECT_EQ(prefix_schedule(confidences, profile({2, 3, 4, 5}, {100, 90, 75, 66})), (std::vector<int>{1, 1}));
  // SPS(3) = 60: 2.9 x 60 = 174 < 200, nothing is verified.
  EXPECT_EQ(prefix_schedule(confidences, profile({2, 3, 4, 5}, {100, 60, 75, 70})), (std::vector<int>{0, 0}));
  // A flat SPS (memory-bound verify) admits every position with survival > 0.
  EXPECT_EQ(prefix_schedule(confidences, profile({1}, {50})), (std::vector<int>{2, 1}));
  // ... but not one of survival 0 (no strict gain), nor anything after it.
  EXPECT_EQ(prefix_schedule(std::vector<std::vector<float>>{{0.7f, 0.0f, 1.0f}}, profile({1}, {50})),
            (std::vector<int>{1}));
  EXPECT_TRUE(prefix_schedule({}, profile({1}, {50})).empty());
}

TEST(PrefixSchedule, StopsAtTheFirstAdmissionThatDoesNotPay) {
  // One row, c = {0.6, 0.9}: survival 0.6 then 0.54. SPS(1) = 100, SPS(2) = 60, SPS(3) = 59.
  // Admitting 0.6: 1.6 x 60 = 96 < 100, so stop, though admitting both would
  // give 2.14 x 59 = 126: deciding position 0 by position 1's confidence (which
  // reads the drafted token 0) is exactly what the early stop forbids.
  const SpsProfile non_concave = profile({1, 2, 3}, {100, 60, 59});
  EXPECT_EQ(prefix_schedule(std::vector<std::vector<float>>{{0.6f, 0.9f}}, non_concave), (std::vector<int>{0}));
}

TEST(PrefixSchedule, WeighsTheRoundsDraftingAndPadsRowsToTheLongest) {
  // The non-concave profile above stops at nothing; with 50 ms of drafting in
  // the round the walk weighs tokens per second of the whole round:
  // 1/0.06 = 16.7, then 1.6/0.0667 = 24.0, then 2.14/0.0669 = 32.0: both in.
  const SpsProfile non_concave = profile({1, 2, 3}, {100, 60, 59});
  const std::vector<std::vector<float>> one_row = {{0.6f, 0.9f}};
  EXPECT_EQ(prefix_schedule(one_row, non_concave, 0, nullptr, {.draft_seconds = 0.05}), (std::vector<int>{2}));
  // Padded: step times 10 / 12 / 14 ms at B = 2 / 4 / 6, and two rows of
  // survival {0.9, 0.09} and {0.05, 0.025}. Unpadded, 0.9 goes in at B = 3
  // (2.9 / 11 ms = 263.6) and 0.09 would drop the rate (2.99 / 12 ms = 249):
  // {1, 0}. Padded, B is R (1 + L) and the walk admits levels: the first
  // (0.9 + 0.05) raises L to 1 (2.95 / 12 ms = 245.8 against 2 / 10 ms), the
  // second (0.09 + 0.025) would raise it to 2 (3.065 / 14 ms = 218.9): {1, 1}, B = 4.
  const SpsProfile steps = profile({2, 4, 6}, {100, 1000.0 / 12, 1000.0 / 14});
  const std::vector<std::vector<float>> two_rows = {{0.9f, 0.1f}, {0.05f, 0.5f}};
  EXPECT_EQ(prefix_schedule(two_rows, steps), (std::vector<int>{1, 0}));
  int tokens = 0;
  EXPECT_EQ(prefix_schedule(two_rows, steps, 0, &tokens, {.padded_rows = true}), (std::vector<int>{1, 1}));
  EXPECT_EQ(tokens, 4);
  // Padded, the walk admits a level when all its rows' positions pay
  // together: four rows of survival 0.5, 10 ms at B = 4 and 12 at B = 8. One
  // position alone would not pay for the level (4.5 / 12 ms = 375 against
  // 4 / 10 ms = 400); the level does (6 / 12 ms = 500).
  const SpsProfile level_steps = profile({4, 8}, {100, 1000.0 / 12});
  const std::vector<std::vector<float>> four_rows(4, std::vector<float>{0.5f});
  EXPECT_EQ(prefix_schedule(four_rows, level_steps, 0, &tokens, {.padded_rows = true}), (std::vector<int>{1, 1, 1, 1}));
  EXPECT_EQ(tokens, 8);
  // A row shorter than L verifies all it has.
  EXPECT_EQ(prefix_schedule(std::vector<std::vector<float>>{{0.9f, 0.9f}, {}}, profile({1}, {50}), 0, nullptr,
                            {.padded_rows = true}),
            (std::vector<int>{2, 0}));
}

TEST(PrefixSchedule, TiesKeepEachRowAPrefixAndExtraTokensCountInB) {
  const std::vector<std::vector<float>> certain = {{1.0f, 1.0f, 1.0f}, {1.0f, 1.0f}};
  EXPECT_EQ(prefix_schedule(certain, profile({1}, {10})), (std::vector<int>{3, 2}));
  // Step time 1 + B/10: B = 2 gives rate 2 / 1.2; admitting 0.5 at B = 3: 2.5 / 1.3 > 2 / 1.2.
  const SpsProfile linear = profile({1, 1001}, {1 / 1.1, 1 / 101.1});
  const std::vector<std::vector<float>> one = {{0.5f}, {}};
  EXPECT_EQ(prefix_schedule(one, linear), (std::vector<int>{1, 0}));
  // Admitting a at B pays when a > τ* / (10 + B): 2 / 12 = 0.167 at B = 2, but
  // 2 / 42 = 0.048 when 30 tokens are verified anyway (B = 32): 0.1 is out, then in.
  EXPECT_EQ(prefix_schedule(std::vector<std::vector<float>>{{0.1f}, {}}, linear, 0), (std::vector<int>{0, 0}));
  EXPECT_EQ(prefix_schedule(std::vector<std::vector<float>>{{0.1f}, {}}, linear, 30), (std::vector<int>{1, 0}));
}

TEST(PrefixScheduler, RowsWithoutConfidencesAreVerifiedWhole) {
  std::vector<Proposal> proposals(3);
  proposals[0].tokens = {5, 6, 7}, proposals[0].confidence = {0.9f, 0.1f, 0.9f};
  proposals[1].tokens = {8, 9};  // an n-gram proposal: no confidences
  // proposals[2]: nothing proposed
  PrefixScheduler scheduler(profile({1, 1001}, {1 / 1.1, 1 / 101.1}));
  std::vector<int> verify;
  scheduler.schedule(proposals, verify);
  // B starts at 3 + 2; rate 3 / 1.5 = 2. 0.9: 3.9 / 1.6 = 2.44 in; 0.09: 3.99 / 1.7 = 2.35 out.
  EXPECT_EQ(verify, (std::vector<int>{1, 2, 0}));
}

TEST(DraftCostProfile, InterpolatesAndScalesPerRowPastTheLastPoint) {
  const DraftCostProfile cost{{1, 4}, {0.002, 0.005}};
  EXPECT_DOUBLE_EQ(cost.at(1), 0.002);
  EXPECT_DOUBLE_EQ(cost.at(0), 0.002);
  EXPECT_NEAR(cost.at(2), 0.003, 1e-12);
  EXPECT_NEAR(cost.at(8), 0.010, 1e-12);  // 1.25 ms a row, as at the last point
  const DraftCostProfile round_trip = DraftCostProfile::from_json(cost.to_json(), "test");
  EXPECT_EQ(round_trip.rows, cost.rows);
  EXPECT_EQ(round_trip.seconds, cost.seconds);
  EXPECT_NE(testing::error_of([] { DraftCostProfile::from_json(Json{{"rows", {2, 1}}, {"seconds", {1, 1}}}, "x"); })
                .find("ascending"),
            std::string::npos);
  // Measured at several lengths: linear in L between them (clamped), then across R.
  const DraftCostProfile by_length{{1, 4}, {0.001, 0.003, 0.002, 0.006}, {1, 5}};
  EXPECT_DOUBLE_EQ(by_length.at(1, 1), 0.001);
  EXPECT_NEAR(by_length.at(1, 3), 0.002, 1e-12);
  EXPECT_DOUBLE_EQ(by_length.at(1, 9), 0.003);  // past the last length
  EXPECT_DOUBLE_EQ(by_length.at(1), 0.003);     // γ: the last length
  EXPECT_NEAR(by_length.at(2, 3), 0.002 + (0.004 - 0.002) / 3, 1e-12);
  EXPECT_NEAR(by_length.at(8, 5), 0.012, 1e-12);
  const DraftCostProfile lengths_trip = DraftCostProfile::from_json(by_length.to_json(), "test");
  EXPECT_EQ(lengths_trip.lengths, by_length.lengths);
  EXPECT_EQ(lengths_trip.seconds, by_length.seconds);
  EXPECT_NE(testing::error_of([] {
              DraftCostProfile::from_json(Json{{"rows", {1}}, {"seconds", {1, 1, 1}}, {"lengths", {1, 2}}}, "x");
            }).find("one time for each row count and length"),
            std::string::npos);
}

// The draft length: with D(R, L) measured at several L, a round drafts the L
// that maximises R (1 + Σ_{j<L} ā_j) / (D(R, L) + verify(R, L)), ā_j the
// smoothed mean survival of position j; before every position's survival is
// known, and every 16th drafted round after, it drafts γ.
TEST(PrefixScheduler, DraftsTheLengthThatPaysBest) {
  const SpsProfile flat = profile({1, 1000}, {100.0, 100.0});  // verify: 10 ms at any B
  // Drafting: 1 ms + 2 ms a position at one row.
  const DraftCostProfile cost{{1}, {0.003, 0.005, 0.007, 0.009}, {1, 2, 3, 4}};
  std::vector<Proposal> rounds(1);
  rounds[0].tokens = {1, 2, 3, 4};
  rounds[0].confidence = {0.9f, 0.5f, 0.5f, 0.5f};  // survival 0.9, 0.45, 0.225, 0.1125
  const Outlook one({64});
  std::vector<int> verify, lengths;
  PrefixScheduler scheduler(flat, cost);
  for (int round = 0; round < 18; ++round) {
    ASSERT_EQ(scheduler.rows_to_draft(one), 1) << round;
    lengths.push_back(scheduler.draft_length(4));
    scheduler.schedule(rounds, verify);
  }
  // Rates at L = 1..4: 1.9 / 13 ms, 2.35 / 15, 2.575 / 17, 2.6875 / 19 = 146, 157, 151, 141 tokens/s: L = 2.
  std::vector<int> expected(18, 2);
  expected[0] = 4;                 // nothing measured yet
  expected[1] = expected[17] = 4;  // the first decision, then every 16th, draft γ
  EXPECT_EQ(lengths, expected);
  // Cheaper positions (1 ms each): 1.9 / 12, 2.35 / 13, 2.575 / 14, 2.6875 / 15 ms: 158, 181, 184, 179: L = 3.
  PrefixScheduler cheaper(flat, DraftCostProfile{{1}, {0.002, 0.003, 0.004, 0.005}, {1, 2, 3, 4}});
  for (int round = 0; round < 3; ++round) {
    cheaper.rows_to_draft(one);
    lengths[round] = cheaper.draft_length(4);
    cheaper.schedule(rounds, verify);
  }
  EXPECT_EQ(std::vector<int>(lengths.begin(), lengths.begin() + 3), (std::vector<int>{4, 4, 3}));
  // Measured at γ alone (no lengths), or without a draft cost profile: γ.
  PrefixScheduler unmeasured(flat, DraftCostProfile{{1}, {0.017}}), alone(flat);
  for (PrefixScheduler* other : {&unmeasured, &alone})
    for (int round = 0; round < 3; ++round) {
      other->rows_to_draft(one);
      EXPECT_EQ(other->draft_length(4), 4);
      other->schedule(rounds, verify);
    }
}

// The gate before a round: with verification free (SPS flat at 100 steps/s,
// 10 ms) and drafting costing D, a round predicts τ* / (10 ms + D) tokens/s
// against plain decoding's 100. Rounds that do not pay leave the next 1, 2,
// 4, ... rounds undrafted; a smoothed gain back at >= 1 drafts every round.
// Single-row rounds through the gate: 'D' where the row drafts (the round
// then schedules `first` in round 0, `later` after it), '.' where it does
// not; with seconds_for, each round is then observed to take seconds_for(drafted).
std::string gate_pattern(PrefixScheduler& scheduler, int rounds, const std::vector<Proposal>& first,
                         const std::vector<Proposal>& later, const std::function<double(bool)>& seconds_for = {}) {
  const Outlook one({64});  // one row that may still emit 64 tokens
  std::vector<int> verify;
  std::string pattern;
  for (int round = 0; round < rounds; ++round) {
    const bool draft = scheduler.rows_to_draft(one) == 1;
    pattern += draft ? 'D' : '.';
    if (draft) scheduler.schedule(round == 0 ? first : later, verify);
    if (seconds_for) scheduler.observe_round(seconds_for(draft));
  }
  return pattern;
}

// `rounds` rounds of four rows through a gate that `probe` keeps shut: the
// runs of plain rounds between drafted ones ("1 2 4 "), and in `left` the
// plain rounds run since the last drafted one.
std::string plain_runs(PrefixScheduler& scheduler, int rounds, const std::vector<Proposal>& probe, int& left) {
  std::string runs;
  std::vector<int> verify;
  left = 0;
  for (int round = 0; round < rounds; ++round) {
    if (scheduler.rows_to_draft(Outlook(std::vector<int>(4, 64))) == 0) {
      ++left;
      continue;
    }
    scheduler.schedule(probe, verify);
    if (left > 0) runs += std::to_string(left) + " ";
    left = 0;
  }
  return runs;
}

TEST(PrefixScheduler, LeavesRoundsUndraftedWhileDraftingDoesNotPay) {
  const SpsProfile flat = profile({1, 1000}, {100.0, 100.0});
  std::vector<Proposal> good(1), poor(1);
  good[0].tokens = {1, 2}, good[0].confidence = {0.9f, 0.9f};  // τ* = 2.71 at B = 3
  poor[0].tokens = {1}, poor[0].confidence = {0.05f};          // τ* = 1.05 at B = 2
  std::vector<int> verify;
  const Outlook one({64});  // one row that may still emit 64 tokens
  // Cheap drafting (1 ms): 2.71 / 11 ms = 246 tokens/s, gain 2.46: every round drafts.
  PrefixScheduler cheap(flat, DraftCostProfile{{1}, {0.001}});
  for (int round = 0; round < 6; ++round) {
    ASSERT_EQ(cheap.rows_to_draft(one), 1) << round;
    cheap.schedule(good, verify);
    EXPECT_EQ(verify, std::vector<int>{2});
  }
  EXPECT_NEAR(cheap.gain(), 2.71 / 0.011 / 100, 1e-6);  // 0.9f is not 0.9
  // Dear drafting (100 ms): gain 0.25 every time: undrafted runs of 1, 2, 4, 8.
  PrefixScheduler dear(flat, DraftCostProfile{{1}, {0.1}});
  EXPECT_EQ(gate_pattern(dear, 19, good, good), "D.D..D....D........");
  // Near the break-even point (10 ms): poor rounds gain 0.525, good ones 1.355;
  // the gain, smoothed by eighths, goes 0.525, 0.63, 0.72, 0.80, 0.87, 0.93,
  // 0.98, 1.03 over the probes that follow runs of 1, 2, 4, ... 32 plain
  // rounds (at one row at most 32, a near miss of 0.9 or more included):
  // drafting then resumes every round.
  PrefixScheduler even(flat, DraftCostProfile{{1}, {0.01}});
  std::string resumes = "D";
  for (int run : {1, 2, 4, 8, 16, 32, 32}) resumes += std::string(run, '.') + "D";
  EXPECT_EQ(gate_pattern(even, int(resumes.size()) + 3, poor, good), resumes + "DDD");
  EXPECT_NEAR(even.gain(), 1.355 - (1.355 - 0.525) * std::pow(kStay, 10), 1e-6);  // ten good rounds
  // Four rows: a closed gate probes with one row, whose round is scaled to
  // four for the estimate (the same gain as four such rows drafting), and
  // verifies none of its drafts (the round stays a plain step).
  PrefixScheduler batch(flat, DraftCostProfile{{1}, {0.1}});
  std::vector<Proposal> four(4, good[0]), probe(4);
  probe[0] = good[0];
  std::vector<int> drafting;
  for (int round = 0; round < 6; ++round) {
    drafting.push_back(batch.rows_to_draft(Outlook(std::vector<int>(4, 64))));
    if (drafting.back() == 4) batch.schedule(four, verify);
    if (drafting.back() == 1) {
      batch.schedule(probe, verify);
      EXPECT_EQ(verify, (std::vector<int>{0, 0, 0, 0}));
    }
  }
  EXPECT_EQ(drafting, (std::vector<int>{4, 0, 1, 0, 0, 1}));
  EXPECT_NEAR(batch.gain(), (4 + 4 * 1.71) / (0.01 + 0.4) / 400, 1e-6);  // D(4) = 4 x 100 ms past the last point
  // The runs of plain rounds stop growing at 512; a batch that shrinks past
  // a power of two (four rows to two) is looked at again at once.
  PrefixScheduler shut(flat, DraftCostProfile{{1}, {0.1}});
  int plain_run = 0;
  EXPECT_EQ(plain_runs(shut, 1600, probe, plain_run), "1 2 4 8 16 32 64 128 256 512 512 ");
  EXPECT_EQ(plain_run, 1600 - 1535 - 12);                              // into the next run of 512
  EXPECT_EQ(shut.rows_to_draft(Outlook(std::vector<int>(3, 64))), 0);  // 3 rows: the same power of two
  EXPECT_EQ(shut.rows_to_draft(Outlook(std::vector<int>(2, 64))), 1);
  // Back at four rows the gate resumes its run of plain rounds (a probe
  // comes after 1600 - 1535 - 12 + 1 = 54 of its 512, not at once).
  shut.schedule(probe, verify);
  for (int round = 0; round < 512 - 54; ++round) ASSERT_EQ(shut.rows_to_draft(Outlook(std::vector<int>(4, 64))), 0);
  EXPECT_EQ(shut.rows_to_draft(Outlook(std::vector<int>(4, 64))), 1);
  // A near miss (a gain of 0.9 or more) looks again after at most 128 plain
  // rounds: here four rows gain 10.84 / (10 + 4 x 4.57 ms) / 400 = 0.958.
  PrefixScheduler near(flat, DraftCostProfile{{1}, {0.00457}});
  EXPECT_EQ(plain_runs(near, 393, probe, plain_run), "1 2 4 8 16 32 64 128 128 ");
  EXPECT_GT(near.gain(), 0.9);
  // Without a draft cost profile the gate never closes (Alg 1 alone).
  PrefixScheduler alone(flat);
  for (int round = 0; round < 4; ++round) {
    EXPECT_EQ(alone.rows_to_draft(one), 1);
    alone.schedule(poor, verify);
  }
}

// A batch that drains (no request waiting) is judged by its slowest row and
// has gates of its own: its rounds shutting them leave the gate of the same
// size that waiting requests refill as it was.
TEST(PrefixScheduler, DrainingBatchesHaveGatesOfTheirOwn) {
  const SpsProfile flat = profile({1, 1000}, {100.0, 100.0});
  std::vector<Proposal> good(4), poor(3);
  for (Proposal& proposal : good) proposal.tokens = {1, 2}, proposal.confidence = {0.9f, 0.9f};
  for (Proposal& proposal : poor) proposal.tokens = {1}, proposal.confidence = {0.05f};
  PrefixScheduler scheduler(flat, DraftCostProfile{{1}, {0.001}});  // D(R) = R ms
  std::vector<int> verify;
  // Four rows refilled from a queue: 4 x 2.71 tokens / 14 ms against 400 tokens/s, gain 1.94.
  const Outlook refilled(std::vector<int>(4, 64), /*waiting=*/8);
  for (int round = 0; round < 3; ++round) {
    ASSERT_EQ(scheduler.rows_to_draft(refilled), 4);
    scheduler.schedule(good, verify);
  }
  // The queue's tail: three rows of 1.05 tokens a round, 3.15 / 13 ms against
  // 300, gain 0.81 (once the rows' paces, smoothed by halves from 2.71, come
  // down): the draining gate, started from 1.94, shuts after 15 rounds.
  const Outlook tail(std::vector<int>(3, 64));
  int drafted = 0;
  while (scheduler.rows_to_draft(tail) == 3 && drafted < 40) scheduler.schedule(poor, verify), ++drafted;
  EXPECT_EQ(drafted, 15);
  EXPECT_LT(scheduler.gain(), 1.0);
  // Refilled again, the batch drafts at once: its gate was not shut by the tail.
  EXPECT_EQ(scheduler.rows_to_draft(refilled), 4);
  scheduler.schedule(good, verify);
  EXPECT_GT(scheduler.gain(), 1.9);
}

// The gate times the rounds it runs: drafted rounds that take longer than the
// profiles predict (a ragged verify that replays no graph) close it although
// the profiles say drafting pays; undrafted rounds that cost more than the
// profile's plain step make drafting look better by as much. A cost ratio is
// the median of the last five timed rounds of its kind, from the third on.
TEST(PrefixScheduler, GateScalesItsEstimateByTimedRounds) {
  const SpsProfile flat = profile({1, 1000}, {100.0, 100.0});  // 10 ms steps
  std::vector<Proposal> good(1);
  good[0].tokens = {1, 2}, good[0].confidence = {0.9f, 0.9f};
  const double e_good = 1 + 0.9f + double(0.9f) * 0.9f;  // tokens a good round is expected to emit
  const Outlook one({64});
  std::vector<int> verify;
  // The profiles predict 10 + 1 ms a round (gain 2.46); each drafted round takes 40 ms.
  PrefixScheduler slow(flat, DraftCostProfile{{1}, {0.001}});
  // gain: 2.46 until three drafted rounds are timed (the first round has no
  // drafted round before it), then an eighth of the way to 2.71 / 40 ms / 100
  // = 0.68 each drafted round: below 1 after the thirteenth such round.
  EXPECT_EQ(gate_pattern(slow, 19, good, good, [](bool drafted) { return drafted ? 0.040 : 0.010; }),
            "DDDDDDDDDDDDDDDDD.D");
  const double untimed_gain = e_good / 0.011 / 100, timed_gain = e_good / 0.040 / 100;
  EXPECT_NEAR(slow.gain(), timed_gain + (untimed_gain - timed_gain) * std::pow(kStay, 14), 1e-6);
  // One slow round among timed ones that keep to the prediction moves nothing (a median).
  PrefixScheduler lone(flat, DraftCostProfile{{1}, {0.001}});
  int drafted = 0;
  EXPECT_EQ(gate_pattern(lone, 8, good, good, [&](bool) { return ++drafted == 4 ? 0.040 : 0.011; }), "DDDDDDDD");
  EXPECT_NEAR(lone.gain(), untimed_gain, 1e-6);
  // A round far slower than predicted (4x: a graph being captured) is not counted.
  PrefixScheduler one_off(flat, DraftCostProfile{{1}, {0.001}});
  for (int round = 0; round < 3; ++round) {
    ASSERT_EQ(one_off.rows_to_draft(one), 1);
    one_off.schedule(good, verify);
    one_off.observe_round(0.5);
  }
  EXPECT_NEAR(one_off.gain(), untimed_gain, 1e-6);
  // Nor is a round that ran a shape for one of its first times (warming up).
  PrefixScheduler warming(flat, DraftCostProfile{{1}, {0.001}});
  for (int round = 0; round < 6; ++round) {
    ASSERT_EQ(warming.rows_to_draft(one), 1);
    warming.schedule(good, verify);
    warming.observe_round(0.040, /*warming_up=*/true);
  }
  EXPECT_NEAR(warming.gain(), untimed_gain, 1e-6);
  // Undrafted rounds at 20 ms (twice the plain step the profile measured): a
  // drafted round at 30 ms against them gains 2.71 / 30 ms over 1 / 20 ms.
  PrefixScheduler dear_plain(flat, DraftCostProfile{{1}, {0.001}});
  for (int round = 0; round < 3; ++round) {
    ASSERT_EQ(dear_plain.rows_to_draft(one), 1);
    dear_plain.observe_round(0.020);  // (as if undrafted: schedule() was not called)
  }
  for (int round = 0; round < 8; ++round) {
    ASSERT_EQ(dear_plain.rows_to_draft(one), 1) << round;
    dear_plain.schedule(good, verify);
    dear_plain.observe_round(0.030);
  }
  // (the drafted rounds' ratio counts from the fourth: the first is untimed)
  const double against_timed = e_good / 0.030 / (1 / 0.020), untimed = e_good / 0.011 / (1 / 0.020);
  EXPECT_NEAR(dear_plain.gain(), against_timed + (untimed - against_timed) * std::pow(kStay, 4), 1e-6);
}

// Rounds of four rows (requests waiting) through a gate, each observed to
// take and emit outcome(kind), kind 'D' where every row drafts, 'p' a probe,
// '.' none; returned as runs ("13D 16. 1p"). The rows draft three tokens at
// confidence 0.95 in the first `confident` rounds, then two at 0.9.
std::string delivered_runs(PrefixScheduler& scheduler, int rounds,
                           const std::function<std::pair<double, long>(char)>& outcome, int confident = 0) {
  Proposal good, better;
  good.tokens = {1, 2}, good.confidence = {0.9f, 0.9f};
  better.tokens = {1, 2, 3}, better.confidence = {0.95f, 0.95f, 0.95f};
  const Outlook four(std::vector<int>(4, 64), /*waiting=*/8);
  std::vector<int> verify;
  std::string runs;
  char last = 0;
  int run = 0;
  for (int round = 0; round <= rounds; ++round) {
    char kind = 0;
    if (round < rounds) {
      const Proposal& drafts = round < confident ? better : good;
      const int drafting = scheduler.rows_to_draft(four);
      kind = drafting == 4 ? 'D' : drafting == 1 ? 'p' : '.';
      if (drafting == 4) scheduler.schedule(std::vector<Proposal>(4, drafts), verify);
      if (drafting == 1) scheduler.schedule(std::vector<Proposal>{drafts, {}, {}, {}}, verify);
      const auto [seconds, tokens] = outcome(kind);
      scheduler.observe_round(seconds, false, tokens);
    }
    if (kind == last) {
      ++run;
      continue;
    }
    if (run > 0) runs += (runs.empty() ? "" : " ") + std::to_string(run) + last;
    last = kind, run = 1;
  }
  return runs;
}

// Where rounds report their tokens, what drafted and undrafted rounds
// delivered decides once both are known (scheduler.h: the rates delivered):
// drafted rounds count from the second of a run (the first projects what
// undrafted rounds staged) and are known after 12 rounds and 64 rows (the
// sums decaying by 1/512 a row: 18 rounds of four rows); then 16 undrafted
// rounds are tried, unless drafted rounds already deliver over 1/0.9 of what
// undrafted ones are predicted to (4 tokens a 10 ms plain step). The kind not
// in use is tried (again) once it has not run for 16 x 128 x |1 - the rates'
// ratio| rounds (at least 256).
TEST(PrefixScheduler, GateFollowsTheRatesRoundsDelivered) {
  const SpsProfile flat = profile({1, 1000}, {100.0, 100.0});  // 10 ms steps
  // The estimate says drafting pays (4 x 2.71 tokens in 10 + 4 ms, gain
  // 1.94), and drafted rounds take the predicted 14 ms, but they emit 4
  // tokens (286 a second) where undrafted ones emit 4 in 10 ms (400, ratio
  // 0.714): after the trial the gate stays shut, and drafts 16 rounds again
  // once drafting has not run for 585 rounds.
  PrefixScheduler optimistic(flat, DraftCostProfile{{1}, {0.001}});
  const auto poor_drafts = [](char kind) { return std::pair{kind == 'D' ? 0.014 : 0.010, 4L}; };
  EXPECT_EQ(delivered_runs(optimistic, 1100, poor_drafts), "19D 586. 16D 479.");
  EXPECT_GT(optimistic.gain(), 1.9);  // the estimate itself never changed
  // Without tokens reported (sampling) the estimate alone decides: every round drafts.
  PrefixScheduler sampling(flat, DraftCostProfile{{1}, {0.001}});
  EXPECT_EQ(delivered_runs(sampling, 100, [](char) { return std::pair{0.014, -1L}; }), "100D");
  // Drafting costs 4 x 4.57 ms: three confident tokens a row estimate 1.31,
  // two at 0.9 a near miss, 0.958. Drafted rounds emit 16 tokens in the
  // predicted 28.28 ms (566 a second, 1.415 x the undrafted rounds' 400):
  // no trial of undrafted rounds at first; after 40 confident rounds the
  // estimate falls below 1, but the gate keeps drafting, and tries undrafted
  // rounds every 849 rounds (16 x 128 x 0.415: first against their
  // prediction, then against what they delivered, both 400 a second).
  PrefixScheduler pessimistic(flat, DraftCostProfile{{1}, {0.00457}});
  const auto good_drafts = [](char kind) { return kind == 'D' ? std::pair{0.02828, 16L} : std::pair{0.010, 4L}; };
  EXPECT_EQ(delivered_runs(pessimistic, 2000, good_drafts, 40), "850D 16. 849D 16. 269D");
  EXPECT_LT(pessimistic.gain(), 1.0);
  // Drafted rounds just above the prediction (12 tokens in 28.28 ms, 424 a
  // second: under 1/0.9 x 400) still try undrafted rounds at once, and again
  // every 256 rounds (the least: 16 x 128 x 0.06 is 122).
  PrefixScheduler close(flat, DraftCostProfile{{1}, {0.00457}});
  const auto close_drafts = [](char kind) { return kind == 'D' ? std::pair{0.02828, 12L} : std::pair{0.010, 4L}; };
  EXPECT_EQ(delivered_runs(close, 400, close_drafts, 400), "19D 16. 256D 16. 93D");
  // Drafting at 4 x 6 ms: confident rows estimate 1.09, the others 0.797.
  // Drafted rounds emit 4 tokens in 34 ms (118 a second, ratio 0.294): shut
  // after the first trial; the second trial of drafting (1446 rounds on)
  // brings the estimate to 0.83, so in place of the third a probe looks.
  PrefixScheduler far(flat, DraftCostProfile{{1}, {0.006}});
  const auto far_drafts = [](char kind) { return std::pair{kind == 'D' ? 0.034 : 0.010, 4L}; };
  EXPECT_EQ(delivered_runs(far, 3000, far_drafts, 40), "19D 1447. 16D 1446. 1p 71.");
  EXPECT_LT(far.gain(), 0.9);
}

// A batch runs until its last row is done, so the gate's estimate follows
// the row with the most rounds left (n_r / e_r), not the rows' mean: a poor
// row with as much left as a good one holds the batch to its own 1.05
// tokens a round; once it is nearly done, the good row sets the pace.
TEST(PrefixScheduler, GainFollowsTheRowThatHoldsTheBatch) {
  const SpsProfile flat = profile({1, 1000}, {100.0, 100.0});
  Proposal good, poor;
  good.tokens = {1, 2}, good.confidence = {0.9f, 0.9f};  // e = 1 + 0.9 + 0.81 = 2.71
  poor.tokens = {1}, poor.confidence = {0.05f};          // e = 1.05
  const std::vector<Proposal> round = {good, poor};
  const double e_good = 1 + 0.9f + double(0.9f) * 0.9f, e_poor = 1 + double(0.05f);
  const double seconds = 0.01 + 0.001;  // a flat 10 ms forward + D(2) = 2 x 0.5 ms past the last point
  std::vector<int> verify;
  PrefixScheduler even_lengths(flat, DraftCostProfile{{1}, {0.0005}});
  ASSERT_EQ(even_lengths.rows_to_draft(Outlook({64, 64})), 2);
  even_lengths.schedule(round, verify);
  EXPECT_EQ(verify, (std::vector<int>{2, 1}));
  EXPECT_NEAR(even_lengths.gain(), 2 * e_poor / seconds / 200, 1e-6);
  PrefixScheduler poor_nearly_done(flat, DraftCostProfile{{1}, {0.0005}});
  ASSERT_EQ(poor_nearly_done.rows_to_draft(Outlook({64, 2})), 2);
  poor_nearly_done.schedule(round, verify);
  EXPECT_NEAR(poor_nearly_done.gain(), 2 * e_good / seconds / 200, 1e-6);
  // Without remaining lengths (schedule() alone) every row counts alike: the slowest sets the pace.
  PrefixScheduler no_lengths(flat, DraftCostProfile{{1}, {0.0005}});
  no_lengths.schedule(round, verify);
  EXPECT_NEAR(no_lengths.gain(), 2 * e_poor / seconds / 200, 1e-6);
  // While requests wait for a place (continuous batching) a finished row is
  // replaced at once: the batch progresses by its rows' total, e_good + e_poor.
  PrefixScheduler replaced(flat, DraftCostProfile{{1}, {0.0005}});
  ASSERT_EQ(replaced.rows_to_draft(Outlook({64, 64}, /*waiting=*/3)), 2);
  replaced.schedule(round, verify);
  EXPECT_NEAR(replaced.gain(), (e_good + e_poor) / seconds / 200, 1e-6);
  // A probe's one row stands for all of them.
  PrefixScheduler replaced_probe(flat, DraftCostProfile{{1}, {0.0005}});
  ASSERT_EQ(replaced_probe.rows_to_draft(Outlook({64, 64}, 3)), 2);
  replaced_probe.schedule(std::vector<Proposal>{good, Proposal{}}, verify);
  EXPECT_NEAR(replaced_probe.gain(), 2 * e_good / (0.01 + 0.001) / 200, 1e-6);
}

// A shut gate's probe drafts one row of R and verifies none of it; for the
// estimate that row stands for all R, as Alg 1 would schedule R copies of
// its confidences. Alone beside R - 1 pending tokens it would verify less:
// here the step time jumps from 10 to 11 ms at B = 6, which a second
// position (survival 0.45) does not pay for and another row's first (0.9) does.
TEST(PrefixScheduler, ProbeStandsForEveryRowAsAlg1WouldScheduleThem) {
  const SpsProfile jump = profile({1, 4, 5, 6, 32}, {100.0, 100.0, 100.0, 1 / 0.011, 1 / 0.011});
  Proposal poor, probe_row;
  poor.tokens = {1}, poor.confidence = {0.05f};
  probe_row.tokens = {1, 2}, probe_row.confidence = {0.9f, 0.5f};
  PrefixScheduler scheduler(jump, DraftCostProfile{{1}, {0.0001}});  // D(4) = 0.4 ms
  const Outlook four(std::vector<int>(4, 64), /*waiting=*/8);
  std::vector<int> verify;
  // Four poor rows: Alg 1 verifies one draft (B = 5, 10 ms), the gain falls below 1.
  ASSERT_EQ(scheduler.rows_to_draft(four), 4);
  scheduler.schedule(std::vector<Proposal>(4, poor), verify);
  EXPECT_EQ(verify, (std::vector<int>{1, 0, 0, 0}));
  const double first = (4 + double(0.05f)) / 0.0104 / 400;
  EXPECT_NEAR(scheduler.gain(), first, 1e-9);
  ASSERT_EQ(scheduler.rows_to_draft(four), 0);
  ASSERT_EQ(scheduler.rows_to_draft(four), 1);  // the probe
  scheduler.schedule(std::vector<Proposal>{probe_row, Proposal{}, Proposal{}, Proposal{}}, verify);
  EXPECT_EQ(verify, (std::vector<int>{0, 0, 0, 0}));  // not verified
  // Four copies: every first position, then every second (B = 12, 11 ms),
  // e = 1 + 0.9 + 0.45 a row; alone the row would have verified one (e = 1.9).
  const double e = 1 + double(0.9f) + double(0.9f) * double(0.5f);
  EXPECT_NEAR(scheduler.gain(), kStay * first + kMove * (4 * e / 0.0114 / 400), 1e-9);
}

// The slowest row is judged by its pace over the rounds it drafted, not by
// one round's confidences: two rows that take turns at a good and a poor
// round each emit (e_good + e_poor) / 2 a round on average, and the batch
// finishes at that pace, where the slower of each round alone says e_poor.
TEST(PrefixScheduler, SlowestRowIsJudgedByItsSmoothedPace) {
  const SpsProfile flat = profile({1, 1000}, {100.0, 100.0});
  Proposal good, poor;
  good.tokens = {1, 2}, good.confidence = {0.9f, 0.9f};
  poor.tokens = {1}, poor.confidence = {0.05f};
  const double e_good = 1 + 0.9f + double(0.9f) * 0.9f, e_poor = 1 + double(0.05f);
  const double seconds = 0.01 + 0.0002;  // D(2) = 2 x 0.1 ms: drafting pays even at e_poor
  auto gain_of = [&](double expected) { return 2 * expected / seconds / 200; };
  std::vector<int> verify;
  PrefixScheduler turns(flat, DraftCostProfile{{1}, {0.0001}});
  ASSERT_EQ(turns.rows_to_draft(Outlook({64, 64})), 2);
  turns.schedule(std::vector<Proposal>{good, poor}, verify);
  EXPECT_NEAR(turns.gain(), gain_of(e_poor), 1e-6);  // nothing to smooth yet
  ASSERT_EQ(turns.rows_to_draft(Outlook({60, 62})), 2);
  turns.schedule(std::vector<Proposal>{poor, good}, verify);
  const double paced = (e_good + e_poor) / 2;  // each row's smoothed e_r
  EXPECT_NEAR(turns.gain(), kStay * gain_of(e_poor) + kMove * gain_of(paced), 1e-6);
  // A probe's one row stands for the slowest of both by the share the
  // slowest took of the rows' mean pace where both drafted.
  PrefixScheduler probed(flat, DraftCostProfile{{1}, {0.0001}});
  ASSERT_EQ(probed.rows_to_draft(Outlook({64, 64})), 2);
  probed.schedule(std::vector<Proposal>{good, poor}, verify);
  const double share = e_poor / ((e_good + e_poor) / 2);
  ASSERT_EQ(probed.rows_to_draft(Outlook({63, 63})), 2);
  probed.schedule(std::vector<Proposal>{good, Proposal{}}, verify);
  EXPECT_NEAR(probed.gain(), kStay * gain_of(e_poor) + kMove * gain_of(e_good * share), 1e-6);
  // At four rows, where no round has had every row draft yet, the share
  // measured at two stands in (the slowest of more rows is slower still).
  const double before = probed.gain();
  ASSERT_EQ(probed.rows_to_draft(Outlook(std::vector<int>(4, 62))), 4);
  probed.schedule(std::vector<Proposal>{good, Proposal{}, Proposal{}, Proposal{}}, verify);
  EXPECT_NEAR(probed.gain(), kStay * before + kMove * e_good * share / (0.01 + 0.0004) / 100, 1e-6);
  // A request that starts under a row's id (a longer remaining length) starts its pace afresh.
  PrefixScheduler reused(flat, DraftCostProfile{{1}, {0.0001}});
  ASSERT_EQ(reused.rows_to_draft(Outlook({4, 4})), 2);
  reused.schedule(std::vector<Proposal>{good, good}, verify);
  ASSERT_EQ(reused.rows_to_draft(Outlook({64, 64})), 2);
  reused.schedule(std::vector<Proposal>{poor, poor}, verify);
  EXPECT_NEAR(reused.gain(), kStay * gain_of(e_good) + kMove * gain_of(e_poor), 1e-6);
}

TEST(DraftCostProfile, MeasuredForTheSourceAndCachedBesideSps) {
  TemporaryDirectory directory;
  const auto cache = directory.path / "sps.json";
  const Transformer model = load_transformer(testing::golden_model("qwen3"));
  CpuTarget target(model);
  DrafterConfig config;
  config.gamma = 3, config.d_draft = 32, config.num_layers = 1, config.num_heads = 4, config.markov_rank = 8;
  config.tap_layers = default_tap_layers(model.config.num_layers);
  Drafter drafter = init_drafter(
      config, {model.config.hidden_size, model.config.vocab_size, model.config.rms_norm_eps}, "qwen3", 3);
  testing::randomize_parameters(drafter, 43, 1.0f);
  DSparkSource source(drafter, target_head_of(model), 0.0f);
  const DraftCostProfile first = cached_draft_cost(target, source, "drafter-key", 3, 5, cache);
  EXPECT_EQ(first.rows, (std::vector<int>{1, 2, 4, 5}));
  EXPECT_EQ(first.lengths, (std::vector<int>{1, 2, 3}));  // every length up to γ
  ASSERT_EQ(first.seconds.size(), 4u * 3u);
  for (double seconds : first.seconds) EXPECT_GT(seconds, 0.0);
  const DraftCostProfile again = cached_draft_cost(target, source, "drafter-key", 3, 5, cache);
  EXPECT_EQ(again.seconds, first.seconds);  // read back, not measured again
  EXPECT_EQ(read_json_file(cache)["profiles"].size(), 1u);
  EXPECT_EQ(cached_draft_cost(target, source, "drafter-key", 3, 8, cache).rows.back(), 8);  // more rows: measured
}

TEST(SpsProfile, MeasuredOnceAndCachedPerDeviceAndModel) {
  TemporaryDirectory directory;
  const auto cache = directory.path / "nested" / "sps.json";
  CpuTarget target(load_transformer(testing::golden_model("qwen3")));
  SpsProfileOptions options;
  options.max_tokens = 12;
  options.context = 16;
  options.runs = 2;
  bool measured = false;
  const SpsProfile first = cached_sps_profile(target, "qwen3-key", options, cache, false, &measured);
  EXPECT_TRUE(measured);
  EXPECT_EQ(first.tokens, sps_profile_points(12));
  for (size_t i = 0; i < first.tokens.size(); ++i) {
    EXPECT_GT(first.steps_per_second[i], 0.0);
    if (i) {
      EXPECT_LE(first.steps_per_second[i], first.steps_per_second[i - 1]);  // step time never decreasing
    }
  }
  EXPECT_EQ(first.plain_rows, (std::vector<int>{1, 2}));  // 12 tokens, 8 a sequence: 2 sequences
  for (double rate : first.plain_steps_per_second) EXPECT_GT(rate, 0.0);
  EXPECT_EQ(first.round_drafts, (std::vector<int>{0, 1, 2, 4, 7}));
  EXPECT_EQ(first.round_steps_per_second.size(), 2u * 5u);
  const SpsProfile again = cached_sps_profile(target, "qwen3-key", options, cache, false, &measured);
  EXPECT_FALSE(measured);
  EXPECT_EQ(again.steps_per_second, first.steps_per_second);
  // Another model key is another entry; the first one stays.
  cached_sps_profile(target, "other-key", options, cache, false, &measured);
  EXPECT_TRUE(measured);
  const Json stored = read_json_file(cache);
  EXPECT_EQ(stored["profiles"].size(), 2u);
  // Asking for more tokens than were measured measures again.
  options.max_tokens = 20;
  EXPECT_EQ(cached_sps_profile(target, "qwen3-key", options, cache, false, &measured).tokens.back(), 20);
  EXPECT_TRUE(measured);
  // A corrupt cache file is replaced, not fatal.
  write_text_file_atomic(cache, "{not json");
  cached_sps_profile(target, "qwen3-key", options, cache, false, &measured);
  EXPECT_TRUE(measured);
  EXPECT_TRUE(read_json_file(cache)["profiles"].is_object());
}

TEST(SpsProfile, DefaultCachePathFollowsTheEnvironment) {
  const char* saved_dspark = std::getenv("DSPARK_CACHE_DIR");
  const char* saved_xdg = std::getenv("XDG_CACHE_HOME");
  const std::string dspark_value = saved_dspark ? saved_dspark : "", xdg_value = saved_xdg ? saved_xdg : "";
  ::setenv("DSPARK_CACHE_DIR", "/tmp/a", 1);
  EXPECT_EQ(default_sps_cache_path(), std::filesystem::path("/tmp/a/sps.json"));
  ::unsetenv("DSPARK_CACHE_DIR");
  ::setenv("XDG_CACHE_HOME", "/tmp/b", 1);
  EXPECT_EQ(default_sps_cache_path(), std::filesystem::path("/tmp/b/dspark/sps.json"));
  ::unsetenv("XDG_CACHE_HOME");
  EXPECT_EQ(default_sps_cache_path().filename(), "sps.json");
  EXPECT_EQ(default_sps_cache_path().parent_path().filename(), "dspark");
  if (saved_dspark) ::setenv("DSPARK_CACHE_DIR", dspark_value.c_str(), 1);
  if (saved_xdg) ::setenv("XDG_CACHE_HOME", xdg_value.c_str(), 1);
}

// bench spec with the schedules: a sweep over batch sizes prints every
// schedule beside plain decoding (greedy outputs identical throughout), draws
// the PNG, and caches Alg 1's SPS profile where it was told to.
TEST(CliBenchSpec, SweepsBatchSizesAndSchedulesAndPlotsThroughput) {
  TemporaryDirectory directory;
  const ModelConfig target = load_model_config(testing::golden_model("qwen3"));
  DrafterConfig config;
  config.gamma = 4, config.d_draft = 32, config.num_layers = 1, config.num_heads = 4, config.markov_rank = 8;
  config.tap_layers = default_tap_layers(target.num_layers);
  Drafter drafter = init_drafter(config, {target.hidden_size, target.vocab_size, target.rms_norm_eps}, "qwen3", 3);
  testing::randomize_parameters(drafter, 41, 3.0f);
  drafter.config.sts = StsCalibration{{0.0f, 0.3f, 0.3f, 0.3f}, {1.0f, 1.0f, 1.0f, 1.0f}, 0.5f, 100};
  save_drafter(drafter, directory.path / "drafter");
  const auto prompts = directory.path / "prompts.jsonl";
  write_text_file_atomic(prompts,
                         "{\"prompt\": \"def f(x):\\n    return x\\n\\ndef f(x):\"}\n"
                         "{\"prompt\": \"hello world hello world hello\"}\n");
  const auto plot = directory.path / "sweep.png";
  const auto cache = directory.path / "cache" / "sps.json";
  const std::vector<std::string> common = {"bench",       "spec",
                                           "-m",          testing::golden_model("qwen3").string(),
                                           "-d",          (directory.path / "drafter").string(),
                                           "--prompts",   prompts.string(),
                                           "-n",          "12",
                                           "--sps-cache", cache.string(),
                                           "--json"};
  std::vector<std::string> sweep = common;
  sweep.insert(sweep.end(), {"--batch", "1,2,4", "--plot", plot.string()});
  const auto result = testing::run_dspark(sweep);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const Json out = Json::parse(result.out);
  EXPECT_EQ(out["schedules"], Json({"off", "threshold", "alg1"}));
  ASSERT_EQ(out["points"].size(), 3u);
  for (const Json& point : out["points"]) {
    EXPECT_GT(point["plain_tokens_per_s"].get<double>(), 0.0);
    EXPECT_EQ(point["requests"].get<int>(), std::max(2, point["batch"].get<int>()));  // prompts repeated to fill
    for (const char* schedule : {"off", "threshold", "alg1"}) {
      const Json& mode = point["schedules"][schedule];
      EXPECT_TRUE(mode["all_outputs_match"].get<bool>()) << schedule << " at batch " << point["batch"];
      EXPECT_GT(mode["tokens_per_s"].get<double>(), 0.0);
    }
    // off verifies every proposal; threshold and alg1 verify no more than off proposes.
    EXPECT_DOUBLE_EQ(point["schedules"]["off"]["verified_per_round"].get<double>(),
                     point["schedules"]["off"]["proposed_per_round"].get<double>());
    EXPECT_LE(point["schedules"]["alg1"]["verified_per_round"].get<double>(),
              point["schedules"]["alg1"]["proposed_per_round"].get<double>());
  }
  // Issue 8's figures: the lowest speed-up over the batch sizes, and batch 4's against batch 1's.
  for (const char* schedule : {"off", "threshold", "alg1"}) {
    const Json& summary = out["summary"][schedule];
    double lowest = 1e9, at_1 = 0.0, at_4 = 0.0;
    int lowest_at = 0;
    for (const Json& point : out["points"]) {
      const double speedup = point["schedules"][schedule]["speedup"].get<double>();
      if (speedup < lowest) lowest = speedup, lowest_at = point["batch"].get<int>();
      if (point["batch"].get<int>() == 1) at_1 = speedup;
      if (point["batch"].get<int>() == 4) at_4 = speedup;
    }
    EXPECT_DOUBLE_EQ(summary["lowest_speedup"].get<double>(), lowest) << schedule;
    EXPECT_EQ(summary["lowest_at_batch"].get<int>(), lowest_at) << schedule;
    EXPECT_DOUBLE_EQ(summary["batch4_over_batch1"].get<double>(), at_4 / at_1) << schedule;
    EXPECT_EQ(summary.contains("batch4_share_of_batch1_gain"), at_1 > 1.0) << schedule;
  }
  const std::string png = read_text_file(plot);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_GT(png.size(), 5000u);
  ASSERT_TRUE(std::filesystem::exists(cache));
  EXPECT_EQ(read_json_file(cache)["profiles"].size(), 2u);  // SPS(B) and the drafter's D(R)

  // One batch size and one schedule: the single-run report, the cached profile reused.
  std::vector<std::string> single = common;
  single.insert(single.end(), {"--batch", "2", "--schedule", "alg1"});
  const auto one = testing::run_dspark(single);
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const Json report = Json::parse(one.out);
  EXPECT_EQ(report["schedule"], "alg1");
  EXPECT_TRUE(report["all_outputs_match"].get<bool>());
  EXPECT_NE(report["sps_profile"].get<std::string>().find("read from"), std::string::npos);

  std::vector<std::string> both = common;
  both.insert(both.end(), {"--sweep", "--batch", "2"});
  EXPECT_NE(testing::run_dspark(both).exit_code, 0);  // --sweep is its own list of batch sizes
  std::vector<std::string> unknown = common;
  unknown.insert(unknown.end(), {"--schedule", "fastest"});
  EXPECT_NE(testing::run_dspark(unknown).exit_code, 0);
}

}  // namespace
}  // namespace dspark
