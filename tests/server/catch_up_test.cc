// CatchUp (server/catch_up.h): whom a replacement asks for its slices, and
// when it has them all. The asks are recorded, not sent.
#include "server/catch_up.h"

#include <algorithm>
#include <map>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// Server 1 of 3 catching up; servers 0 and 2 alive unless `dead` says so.
class CatchUpTest : public ::testing::Test {
 protected:
  CatchUp::Options Options(absl::Duration resend = absl::Milliseconds(5)) {
    CatchUp::Options o;
    o.rank = 1;
    o.num_servers = 3;
    o.resend = resend;
    o.states = [this] {
      absl::MutexLock lock(&mu_);
      return states_;
    };
    o.ask = [this](int rank, uint64_t id, uint64_t view) {
      absl::MutexLock lock(&mu_);
      asks_[rank].push_back(id);
      views_[id] = view;
    };
    o.caught_up = [this] {
      absl::MutexLock lock(&mu_);
      ++reports_;
    };
    return o;
  }
  // Waits (at most 5 s) until server `rank` was asked at least `n` times.
  bool AskedAtLeast(int rank, size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&] { return asks_[rank].size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(5));
  }
  int reports() {
    absl::MutexLock lock(&mu_);
    return reports_;
  }
  std::vector<uint64_t> asks(int rank) {
    absl::MutexLock lock(&mu_);
    return asks_[rank];
  }
  // The view ask `id` was made under (0 for an ask never made).
  uint64_t View(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = views_.find(id);
    return it == views_.end() ? 0 : it->second;
  }
  void Kill(int rank) {
    absl::MutexLock lock(&mu_);
    states_[rank].dead = true;
  }

  absl::Mutex mu_;
  std::vector<ServerState> states_ = std::vector<ServerState>(3);
  std::map<int, std::vector<uint64_t>> asks_;
  std::map<uint64_t, uint64_t> views_;  // each ask's view of the table
  int reports_ = 0;
};

TEST_F(CatchUpTest, AsksEveryLiveServerButItselfWithRisingIdsUntilItHasAll) {
  CatchUp c;
  ASSERT_TRUE(c.Start(Options()));
  EXPECT_TRUE(c.active());
  ASSERT_TRUE(AskedAtLeast(0, 3));
  ASSERT_TRUE(AskedAtLeast(2, 3));
  EXPECT_TRUE(asks(1).empty()) << "a server never asks itself";
  // One id sequence across the servers: each ask's id is new.
  std::vector<uint64_t> all = asks(0);
  for (uint64_t id : asks(2)) all.push_back(id);
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end());
  EXPECT_EQ(all.front(), 1u);

  c.Took(0, /*key=*/7, /*offset=*/0, 100);
  // Server 0: all sent; server 2 has not counted.
  EXPECT_TRUE(c.Counted(0, asks(0).back(), View(asks(0).back()), {{7, 0}}));
  EXPECT_EQ(reports(), 0);
  EXPECT_TRUE(c.active());
  EXPECT_TRUE(
      c.Counted(2, asks(2).back(), View(asks(2).back()), {{8, 0}, {8, 64}}));
  c.Took(2, 8, 0, 10);
  c.Took(2, 8, 0, 10);  // the same slice again counts once
  c.Check();
  EXPECT_EQ(reports(), 0) << "server 2 named 2 slices and sent 1";
  c.Took(0, 8, 64, 10);
  c.Check();
  EXPECT_EQ(reports(), 0) << "server 2's slice counts only from server 2";
  c.Took(2, 8, 64, 10);
  c.Check();
  EXPECT_EQ(reports(), 1);
  EXPECT_FALSE(c.active());
  c.Check();
  c.Counted(0, asks(0).back(), View(asks(0).back()), {{7, 0}});
  EXPECT_EQ(reports(), 1) << "reported once";
}

TEST_F(CatchUpTest, AServerThatSentAllIsNotAskedAgain) {
  CatchUp c;
  ASSERT_TRUE(c.Start(Options()));
  ASSERT_TRUE(AskedAtLeast(0, 1));
  c.Counted(0, asks(0).back(), View(asks(0).back()),
            {});  // server 0 holds nothing for it
  const size_t asked0 = asks(0).size();
  ASSERT_TRUE(AskedAtLeast(2, asks(2).size() + 5));
  EXPECT_LE(asks(0).size(), asked0 + 1) << "at most the ask already on its way";
  c.Counted(2, asks(2).back(), View(asks(2).back()), {});
  EXPECT_EQ(reports(), 1);
}

TEST_F(CatchUpTest, ADeadServerIsNeitherAskedNorWaitedFor) {
  CatchUp c;
  Kill(2);
  ASSERT_TRUE(c.Start(Options()));
  ASSERT_TRUE(AskedAtLeast(0, 2));
  EXPECT_TRUE(asks(2).empty());
  c.Counted(0, asks(0).back(), View(asks(0).back()), {});
  EXPECT_EQ(reports(), 1);
}

TEST_F(CatchUpTest, ADeathForgetsTheCountsAndAsksAgainAtOnce) {
  CatchUp c;
  // A long resend: only a Restart can make the second ask come soon.
  ASSERT_TRUE(c.Start(Options(absl::Seconds(60))));
  ASSERT_TRUE(AskedAtLeast(0, 1));
  // Server 0 will send one slice; server 2 has not counted.
  ASSERT_TRUE(c.Counted(0, asks(0).back(), View(asks(0).back()), {{7, 0}}));
  Kill(2);
  c.Restart();  // server 2 died: server 0's count is stale
  ASSERT_TRUE(AskedAtLeast(0, 2));
  c.Took(0, 7, 0, 1);
  c.Check();
  EXPECT_EQ(reports(), 0) << "server 0 must count again after the death";
  ASSERT_TRUE(c.Counted(0, asks(0).back(), View(asks(0).back()), {{7, 0}}));
  EXPECT_EQ(reports(), 1);
}

// Issue #46: a count that answers an ask made before a death (a late answer
// or a replay) named the slices of the old table; only answers to asks made
// since count, and only asks this catch-up made.
TEST_F(CatchUpTest, ACountAnsweringAnAskBeforeTheDeathOrNoAskIsDropped) {
  CatchUp c;
  ASSERT_TRUE(c.Start(Options(absl::Seconds(60))));
  ASSERT_TRUE(AskedAtLeast(0, 1));
  ASSERT_TRUE(AskedAtLeast(2, 1));
  const uint64_t before0 = asks(0).back();
  const uint64_t before2 = asks(2).back();
  c.Restart();
  ASSERT_TRUE(AskedAtLeast(0, 2));
  ASSERT_TRUE(AskedAtLeast(2, 2));
  EXPECT_FALSE(c.Counted(0, before0, View(before0), {}))
      << "server 0's answer to the old ask";
  EXPECT_FALSE(c.Counted(2, before2, View(before2), {}));
  EXPECT_FALSE(
      c.Counted(0, asks(2).back() + 1000, View(asks(2).back() + 1000), {}))
      << "never asked";
  EXPECT_FALSE(c.Counted(0, asks(2).back(), View(asks(2).back()), {}))
      << "an ask of server 2";
  EXPECT_FALSE(c.Counted(0, asks(0).back(), View(asks(0).back()) + 1, {}))
      << "counted under another view of the table";
  EXPECT_EQ(reports(), 0);
  EXPECT_TRUE(c.active());
  EXPECT_TRUE(c.Counted(0, asks(0).back(), View(asks(0).back()), {}));
  EXPECT_EQ(reports(), 0);
  EXPECT_TRUE(c.Counted(2, asks(2).back(), View(asks(2).back()), {}));
  EXPECT_EQ(reports(), 1);
}

// Issue #46: server 0 named slices A and B and sent both; a death moves B
// away and C to it. Its new count is as long as the old one, but C has not
// come: counting slices (2 taken >= 2 counted) would report caught up and
// the replacement would then refuse C as a slice new to a server no longer
// catching up.
TEST_F(CatchUpTest, SlicesTakenBeforeADeathDoNotStandInForTheNewCountsOnes) {
  CatchUp c;
  ASSERT_TRUE(c.Start(Options(absl::Seconds(60))));
  ASSERT_TRUE(AskedAtLeast(0, 1));
  ASSERT_TRUE(
      c.Counted(0, asks(0).back(), View(asks(0).back()), {{1, 0}, {2, 0}}));
  c.Took(0, 1, 0, 10);
  c.Took(0, 2, 0, 10);
  Kill(2);
  c.Restart();
  ASSERT_TRUE(AskedAtLeast(0, 2));
  ASSERT_TRUE(
      c.Counted(0, asks(0).back(), View(asks(0).back()), {{1, 0}, {3, 0}}));
  EXPECT_EQ(reports(), 0) << "slice 3 has not come";
  EXPECT_TRUE(c.active());
  c.Took(0, 3, 0, 10);
  c.Check();
  EXPECT_EQ(reports(), 1);
}

// Between two deaths a server is asked again every resend; a count answers
// the ask it names, and an earlier ask's count coming after a later one's
// does not replace it (review of issue #46's fix).
TEST_F(CatchUpTest, AnEarlierAsksCountComingLateReplacesNoLaterOne) {
  CatchUp c;
  ASSERT_TRUE(c.Start(Options()));  // asks every 5 ms
  ASSERT_TRUE(AskedAtLeast(0, 2));
  const std::vector<uint64_t> ids = asks(0);
  ASSERT_TRUE(c.Counted(0, ids[1], View(ids[1]), {{1, 0}}));
  EXPECT_FALSE(c.Counted(0, ids[0], View(ids[0]), {}))
      << "the earlier ask's count";
  ASSERT_TRUE(c.Counted(2, asks(2).back(), View(asks(2).back()), {}));
  EXPECT_EQ(reports(), 0) << "server 0 still names slice 1";
  c.Took(0, 1, 0, 10);
  c.Check();
  EXPECT_EQ(reports(), 1);
}

// Review of issue #46's fix: a server's death reaches the node table before
// Restart runs; a slice arriving in between must not complete the catch-up on
// counts made under the old table (the dead server's slices move to servers
// whose counts did not name them).
TEST_F(CatchUpTest, CountsUnderTheTableBeforeADeathDoNotCompleteIt) {
  CatchUp c;
  ASSERT_TRUE(c.Start(Options(absl::Seconds(60))));
  ASSERT_TRUE(AskedAtLeast(0, 1));
  ASSERT_TRUE(AskedAtLeast(2, 1));
  ASSERT_TRUE(c.Counted(0, asks(0).back(), View(asks(0).back()), {{1, 0}}));
  ASSERT_TRUE(c.Counted(2, asks(2).back(), View(asks(2).back()), {{2, 0}}));
  Kill(0);  // seen in the table; Restart not yet called
  c.Took(2, 2, 0, 10);
  c.Check();
  EXPECT_EQ(reports(), 0)
      << "server 2 counted under the table before the death";
  EXPECT_TRUE(c.active());
  c.Restart();
  ASSERT_TRUE(AskedAtLeast(2, 2));
  ASSERT_TRUE(
      c.Counted(2, asks(2).back(), View(asks(2).back()), {{2, 0}, {1, 0}}));
  EXPECT_EQ(reports(), 0) << "slice 1 moved to server 2 and has not come";
  c.Took(2, 1, 0, 10);
  c.Check();
  EXPECT_EQ(reports(), 1);
}

// A dead rank's fields other than its death route nothing, and nodes can
// hold different ones (a replacement's notice overtaken by its death): the
// view leaves them out, or a live server would never count for another
// replacement (review of issue #46's fix).
TEST(StatesDigestTest, ADeadRanksOtherFieldsDoNotChangeTheView) {
  std::vector<ServerState> a(3), b(3);
  a[1].dead = b[1].dead = true;
  a[1].joined = 1;
  b[1].joined = 2;
  b[1].catching_up = true;
  EXPECT_EQ(StatesDigest(a), StatesDigest(b));
  b[2].joined = 2;  // a live rank's field is part of the view
  EXPECT_NE(StatesDigest(a), StatesDigest(b));
  b = a;
  b[1].dead = false;
  EXPECT_NE(StatesDigest(a), StatesDigest(b));
}

TEST_F(CatchUpTest, StartsOnceAndNotAfterStop) {
  CatchUp c;
  EXPECT_FALSE(c.active());
  EXPECT_FALSE(c.Counted(0, 1, View(1), {}));  // before Start: nothing reported
  EXPECT_EQ(reports(), 0);
  ASSERT_TRUE(c.Start(Options()));
  EXPECT_FALSE(c.Start(Options())) << "a second Start";
  const absl::Time t0 = absl::Now();
  c.Stop();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  c.Stop();  // idempotent

  CatchUp stopped;
  stopped.Stop();
  EXPECT_FALSE(stopped.Start(Options()));
  EXPECT_FALSE(stopped.active());
}

// Start and Stop on two threads: Stop joins the thread Start made or none
// (the thread is made under the lock; tools/tsan.sh runs this test). Once
// Stop returned, nothing is asked any more.
TEST_F(CatchUpTest, StopOnAnotherThreadThanStartEndsTheAsking) {
  for (int i = 0; i < 20; ++i) {
    CatchUp c;
    std::thread stopper([&] { c.Stop(); });
    c.Start(Options(absl::Milliseconds(1)));
    stopper.join();
    c.Stop();
    const size_t asked = asks(0).size() + asks(2).size();
    absl::SleepFor(absl::Milliseconds(10));
    EXPECT_EQ(asks(0).size() + asks(2).size(), asked) << "run " << i;
  }
}

}  // namespace
}  // namespace tessera
