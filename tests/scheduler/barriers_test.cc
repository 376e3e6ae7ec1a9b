// The scheduler's barriers (scheduler/barriers.h): released when the group is
// all in, answered again on a repeat, finished workers counted in, a
// restarted node let through a barrier already passed, and what /debug/pending
// shows.
#include "scheduler/barriers.h"

#include <string>
#include <utility>
#include <vector>

#include "common/message.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using Answer = std::pair<int, uint64_t>;  // peer, request id

class BarriersTest : public ::testing::Test {
 protected:
  BarriersTest()
      : barriers_(
            Barriers::Membership{
                [this](int group) {
                  return ((group & kGroupServers) ? servers_ : 0) +
                         ((group & kGroupWorkers) ? workers_ : 0);
                },
                [this] { return finished_; },
                [this](int group) {
                  std::vector<std::string> missing;
                  for (int id : members_)
                    if (!barriers_.Waits(group, id))
                      missing.push_back("node " + std::to_string(id));
                  return missing;
                }},
            Barriers::Settings{absl::Seconds(1), 10},
            [this](int peer, uint64_t request) {
              answers_.push_back({peer, request});
            },
            &released_) {}

  // Each of `ids` enters the workers' barrier with request `request`.
  void EnterAll(std::vector<int> ids, uint64_t request) {
    for (int id : ids)
      barriers_.Enter(id, request, kGroupWorkers, "", false, t0_);
  }

  int servers_ = 0;
  int workers_ = 3;
  int finished_ = 0;
  std::vector<int> members_ = {9, 11, 13};
  std::vector<Answer> answers_;
  Counter released_;
  Barriers barriers_;
  const absl::Time t0_ = absl::FromUnixSeconds(1000);
};

TEST_F(BarriersTest, ReleasedWhenTheWholeGroupIsIn) {
  barriers_.Enter(9, 5, kGroupWorkers, "init", false, t0_);
  barriers_.Enter(11, 7, kGroupWorkers, "init", false, t0_);
  EXPECT_TRUE(answers_.empty());
  EXPECT_TRUE(barriers_.Waits(kGroupWorkers, 9));
  EXPECT_FALSE(barriers_.Waits(kGroupWorkers, 13));
  barriers_.Enter(13, 2, kGroupWorkers, "init", false, t0_);
  EXPECT_EQ(answers_, (std::vector<Answer>{{9, 5}, {11, 7}, {13, 2}}));
  EXPECT_EQ(released_.value(), 1u);
  EXPECT_FALSE(barriers_.Waits(kGroupWorkers, 9));
  // A repeat of a released request (its answer was lost) is answered again
  // at once; the node's next request waits as any.
  barriers_.Enter(11, 7, kGroupWorkers, "init", false, t0_);
  EXPECT_EQ(answers_.back(), (Answer{11, 7}));
  EXPECT_EQ(answers_.size(), 4u);
  barriers_.Enter(11, 8, kGroupWorkers, "step", false, t0_);
  EXPECT_EQ(answers_.size(), 4u);
  EXPECT_EQ(released_.value(), 1u);
}

TEST_F(BarriersTest, ANodesNewestRequestIsTheOneAnswered) {
  barriers_.Enter(9, 5, kGroupWorkers, "", false, t0_);
  barriers_.Enter(9, 6, kGroupWorkers, "", false, t0_);  // restarted
  barriers_.Enter(11, 1, kGroupWorkers, "", false, t0_);
  EXPECT_TRUE(answers_.empty());  // 9 counts once
  barriers_.Enter(13, 1, kGroupWorkers, "", false, t0_);
  EXPECT_EQ(answers_, (std::vector<Answer>{{9, 6}, {11, 1}, {13, 1}}));
}

TEST_F(BarriersTest, FinishedWorkersAreInEveryWorkerBarrierOnly) {
  finished_ = 1;
  servers_ = 1;
  barriers_.Enter(9, 1, kGroupWorkers, "", false, t0_);
  barriers_.Enter(11, 1, kGroupWorkers, "", false, t0_);
  EXPECT_EQ(answers_.size(), 2u);  // 2 + 1 finished of 3
  barriers_.Enter(2, 1, kGroupServers | kGroupWorkers, "", false, t0_);
  barriers_.Enter(9, 2, kGroupServers | kGroupWorkers, "", false, t0_);
  barriers_.Enter(11, 2, kGroupServers | kGroupWorkers, "", false, t0_);
  EXPECT_EQ(answers_.size(), 5u);  // 3 + 1 finished of 1 + 3
  barriers_.Enter(4, 1, kGroupServers, "", false, t0_);
  EXPECT_EQ(answers_.size(), 6u);
  EXPECT_EQ(released_.value(), 3u);
}

TEST_F(BarriersTest, ARestartedNodePassesABarrierTheOthersPassedOnly) {
  for (int id : {9, 11, 13})
    barriers_.Enter(id, 1, kGroupWorkers, "keys", false, t0_);
  ASSERT_EQ(answers_.size(), 3u);
  // Node 11 restarts and asks for "keys" again, join_if_open: answered.
  barriers_.Enter(11, 40, kGroupWorkers, "keys", true, t0_);
  EXPECT_EQ(answers_.back(), (Answer{11, 40}));
  EXPECT_FALSE(barriers_.Waits(kGroupWorkers, 11));
  // A barrier not passed yet: it waits there with the others.
  barriers_.Enter(11, 41, kGroupWorkers, "end", true, t0_);
  EXPECT_TRUE(barriers_.Waits(kGroupWorkers, 11));
  EXPECT_EQ(answers_.size(), 4u);
}

TEST_F(BarriersTest, ADepartureCompletesABarrierAndAFreedIdStartsAfresh) {
  EnterAll({9, 11, 13}, 3);
  ASSERT_EQ(answers_.size(), 3u);
  EnterAll({9, 13, 11}, 4);
  ASSERT_EQ(answers_.size(), 6u);
  EnterAll({9, 13}, 5);
  // 13 dies: it waits no more, and the group shrinks to 2 with 9 alone in.
  barriers_.Leave(13);
  workers_ = 2;
  barriers_.ReleaseComplete(t0_);
  EXPECT_EQ(answers_.size(), 6u);
  // 11 leaves too: 9 is the whole group.
  workers_ = 1;
  barriers_.ReleaseComplete(t0_);
  EXPECT_EQ(answers_.back(), (Answer{9, 5}));
  // A joiner under id 11, whose earlier life's request 4 was released, is a
  // new node once forgotten: its request 4 waits.
  workers_ = 2;
  barriers_.Forget(11);
  barriers_.Enter(11, 4, kGroupWorkers, "", false, t0_);
  EXPECT_TRUE(barriers_.Waits(kGroupWorkers, 11));
  EXPECT_EQ(answers_.size(), 7u);
}

TEST_F(BarriersTest, PendingShowsWhoIsInWhoIsMissingAndTheAge) {
  barriers_.Enter(9, 1, kGroupWorkers, "epoch 2", false, t0_);
  barriers_.Enter(13, 1, kGroupWorkers, "epoch 2", false, t0_);
  wire::DebugPending p;
  barriers_.Fill(&p, t0_ + absl::Milliseconds(2500));
  ASSERT_EQ(p.barriers_size(), 1);
  const wire::OpenBarrier& b = p.barriers(0);
  EXPECT_EQ(b.group(), "workers");
  EXPECT_EQ(b.tag(), "epoch 2");
  ASSERT_EQ(b.ids_in_size(), 2);
  EXPECT_EQ(b.ids_in(0), 9);
  EXPECT_EQ(b.ids_in(1), 13);
  ASSERT_EQ(b.missing_size(), 1);
  EXPECT_EQ(b.missing(0), "node 11");
  EXPECT_DOUBLE_EQ(b.age_s(), 2.5);
  EXPECT_STREQ(BarrierGroupName(kGroupServers | kGroupWorkers),
               "servers and workers");
  EXPECT_STREQ(BarrierGroupName(kGroupServers), "servers");
}

}  // namespace
}  // namespace tessera
