// RoundWatch on a fake clock: the late threshold exactly (10 x late_min before
// any round completed, then late_factor x the median, at least late_min), one
// line per key, the doubling before a round is reported again, and what
// /debug/pending shows of open rounds, held messages and rank lags.
#include "server/round_watch.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

RoundWatch::Options NoThread(absl::Duration late_min, double factor = 10) {
  RoundWatch::Options o;
  o.late_min = late_min;
  o.late_factor = factor;
  o.check_every = absl::ZeroDuration();  // CheckLate is called here
  return o;
}

const absl::Time t0 = absl::FromUnixSeconds(1000000);

TEST(RoundWatchTest, BeforeAnyRoundCompletedARoundIsLateAfterTenTimesLateMin) {
  RoundWatch w(3, NoThread(absl::Seconds(1)));
  w.PushTaken(7, 0, 0, t0, t0);
  w.PushTaken(7, 0, 1, t0, t0 + absl::Milliseconds(5));
  EXPECT_THAT(w.CheckLate(t0 + absl::Milliseconds(9999)), IsEmpty());
  EXPECT_THAT(w.CheckLate(t0 + absl::Seconds(10)),
              ElementsAre("dist_sync round of key 7 has waited 10s for rank 2 "
                          "(no round of the key has completed here yet; ranks "
                          "in: 0, 1)"));
  // Again only once the wait has doubled.
  EXPECT_THAT(w.CheckLate(t0 + absl::Seconds(19)), IsEmpty());
  EXPECT_THAT(w.CheckLate(t0 + absl::Seconds(20)),
              ElementsAre("dist_sync round of key 7 has waited 20s for rank 2 "
                          "(no round of the key has completed here yet; ranks "
                          "in: 0, 1)"));
  // Completed: nothing more to say.
  w.PushTaken(7, 0, 2, t0, t0 + absl::Seconds(21));
  w.RoundDone(7, 0, t0, t0 + absl::Seconds(21));
  EXPECT_THAT(w.CheckLate(t0 + absl::Seconds(100)), IsEmpty());
}

// Elastic jobs: a rank out of the job is never named as missing.
TEST(RoundWatchTest, ARankOutOfTheJobIsNotMissing) {
  RoundWatch w(4, NoThread(absl::Seconds(1)));
  w.SetInJob(3, false);
  w.PushTaken(7, 0, 0, t0, t0);
  EXPECT_THAT(w.CheckLate(t0 + absl::Seconds(10)),
              ElementsAre("dist_sync round of key 7 has waited 10s for ranks "
                          "1, 2 (no round of the key has completed here yet; "
                          "ranks in: 0)"));
}

TEST(RoundWatchTest, AfterRoundsTheThresholdIsTheFactorTimesTheirMedian) {
  RoundWatch w(2, NoThread(absl::Milliseconds(100), 10));
  absl::Time t = t0;
  // Rounds of 40, 50 and 60 ms: median 50 ms, threshold 500 ms.
  for (int ms : {40, 60, 50}) {
    w.PushTaken(3, 0, 0, t, t);
    w.PushTaken(3, 0, 1, t, t + absl::Milliseconds(ms));
    w.RoundDone(3, 0, t, t + absl::Milliseconds(ms));
    t += absl::Seconds(1);
  }
  w.PushTaken(3, 0, 1, t, t);
  EXPECT_THAT(w.CheckLate(t + absl::Milliseconds(499)), IsEmpty());
  EXPECT_THAT(
      w.CheckLate(t + absl::Milliseconds(500)),
      ElementsAre("dist_sync round of key 3 has waited 500ms for rank 0 "
                  "(10x the key's recent median round of 50ms; ranks "
                  "in: 1)"));
  // late_min bounds it from below: rounds of 1 ms, late_min 100 ms.
  RoundWatch fast(2, NoThread(absl::Milliseconds(100), 10));
  fast.PushTaken(4, 0, 0, t0, t0);
  fast.RoundDone(4, 0, t0, t0 + absl::Milliseconds(1));
  fast.PushTaken(4, 0, 0, t, t);
  EXPECT_THAT(fast.CheckLate(t + absl::Milliseconds(99)), IsEmpty());
  EXPECT_EQ(fast.CheckLate(t + absl::Milliseconds(100)).size(), 1u);
}

TEST(RoundWatchTest, OneLinePerKeyForItsOldestSliceAndLongListsAreCut) {
  RoundWatch w(40, NoThread(absl::Milliseconds(100)));
  // Key 5 in two slices; the older waits for more ranks.
  w.PushTaken(5, 0, 0, t0, t0);
  w.PushTaken(5, 1000, 0, t0 + absl::Seconds(1), t0 + absl::Seconds(1));
  w.PushTaken(5, 1000, 1, t0 + absl::Seconds(1), t0 + absl::Seconds(1));
  w.PushTaken(9, 0, 39, t0, t0);
  const std::vector<std::string> lines = w.CheckLate(t0 + absl::Seconds(3));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(
      lines[0],
      "dist_sync round of key 5 has waited 3s for ranks 1, 2, 3, 4, 5, 6, "
      "7, 8, 9, 10, 11, 12, 13, 14, 15, 16, ... (39 in all) (no round of "
      "the key has completed here yet; ranks in: 0)");
  EXPECT_EQ(
      lines[1],
      "dist_sync round of key 9 has waited 3s for ranks 0, 1, 2, 3, 4, 5, "
      "6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ... (39 in all) (no round of "
      "the key has completed here yet; ranks in: 39)");
}

TEST(RoundWatchTest, PendingShowsOpenRoundsOldestFirstHeldMessagesAndLags) {
  RoundWatch w(3, NoThread(absl::Seconds(1)));
  // Rank 2 is 30 ms behind in round 1 of key 1; then key 2 opens.
  w.PushTaken(1, 0, 0, t0, t0);
  w.PushTaken(1, 0, 1, t0, t0 + absl::Milliseconds(10));
  w.PushTaken(1, 0, 2, t0, t0 + absl::Milliseconds(30));
  w.RoundDone(1, 0, t0, t0 + absl::Milliseconds(30));
  const absl::Time t1 = t0 + absl::Seconds(1);
  w.PushTaken(2, 0, 1, t1, t1);
  // A second slice of key 2: in its round, not in the lags (a push counts
  // once per key and round).
  w.PushTaken(2, 5000, 1, t1, t1 + absl::Seconds(3), /*count_lag=*/false);
  w.PushTaken(1, 0, 0, t1 + absl::Milliseconds(200),
              t1 + absl::Milliseconds(200));
  w.Waiting(2, 0, 4);
  w.Waiting(1, 0, 3);
  w.Waiting(1, 0, 0);  // drained
  wire::DebugPending p;
  w.Fill(&p, t1 + absl::Seconds(2));
  ASSERT_EQ(p.open_rounds_size(), 3);
  EXPECT_EQ(p.open_rounds_total(), 3);
  EXPECT_EQ(p.open_rounds(1).key(), 2u);
  EXPECT_EQ(p.open_rounds(1).offset(), 5000u);
  EXPECT_THAT(p.open_rounds(1).ranks_in(), ElementsAre(1));
  EXPECT_EQ(p.waiting_total(), 1);
  EXPECT_EQ(p.open_rounds(0).key(), 2u);
  EXPECT_THAT(p.open_rounds(0).ranks_in(), ElementsAre(1));
  EXPECT_THAT(p.open_rounds(0).ranks_missing(), ElementsAre(0, 2));
  EXPECT_DOUBLE_EQ(p.open_rounds(0).age_s(), 2.0);
  EXPECT_DOUBLE_EQ(p.open_rounds(0).median_round_s(), 0.0);
  EXPECT_EQ(p.open_rounds(2).key(), 1u);
  EXPECT_THAT(p.open_rounds(2).ranks_missing(), ElementsAre(1, 2));
  EXPECT_DOUBLE_EQ(p.open_rounds(2).age_s(), 1.8);
  EXPECT_DOUBLE_EQ(p.open_rounds(2).median_round_s(), 0.03);
  ASSERT_EQ(p.waiting_size(), 1);
  EXPECT_EQ(p.waiting(0).key(), 2u);
  EXPECT_EQ(p.waiting(0).count(), 4);
  // Slowest first: rank 2 (30 ms), rank 1 (10 ms), rank 0 (0 ms twice).
  ASSERT_EQ(p.rank_lag_size(), 3);
  EXPECT_EQ(p.rank_lag(0).rank(), 2);
  EXPECT_DOUBLE_EQ(p.rank_lag(0).mean_lag_s(), 0.03);
  EXPECT_EQ(p.rank_lag(1).rank(), 1);
  // Rank 1: 10 ms, then 0 ms: 0.8 x 0.01.
  EXPECT_DOUBLE_EQ(p.rank_lag(1).mean_lag_s(), 0.8 * 0.01);
  EXPECT_EQ(p.rank_lag(1).rounds(), 2u);
  EXPECT_EQ(p.rank_lag(2).rank(), 0);
}

// /debug/pending stays bounded: the oldest kMaxListed open rounds and the
// kMaxListed slices holding most messages, with the totals.
TEST(RoundWatchTest, PendingListsAreBoundedAndCounted) {
  RoundWatch w(2, NoThread(absl::Seconds(1)));
  const int n = static_cast<int>(RoundWatch::kMaxListed) + 50;
  for (int k = 0; k < n; ++k) {
    // Key k opened k ms after t0: the oldest are the smallest keys.
    w.PushTaken(k, 0, 0, t0 + absl::Milliseconds(k),
                t0 + absl::Milliseconds(k));
    w.Waiting(k, 0, static_cast<size_t>(k + 1));
  }
  wire::DebugPending p;
  w.Fill(&p, t0 + absl::Seconds(5));
  EXPECT_EQ(p.open_rounds_total(), n);
  ASSERT_EQ(p.open_rounds_size(), static_cast<int>(RoundWatch::kMaxListed));
  EXPECT_EQ(p.open_rounds(0).key(), 0u);
  EXPECT_EQ(p.open_rounds(p.open_rounds_size() - 1).key(),
            RoundWatch::kMaxListed - 1);
  EXPECT_EQ(p.waiting_total(), n);
  ASSERT_EQ(p.waiting_size(), static_cast<int>(RoundWatch::kMaxListed));
  EXPECT_EQ(p.waiting(0).count(), n);  // the most held first
  EXPECT_EQ(p.waiting(0).key(), static_cast<uint64_t>(n - 1));
}

}  // namespace
}  // namespace tessera
