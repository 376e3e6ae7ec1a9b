// KVServer in one process, no sockets: messages go straight into Handle and
// replies are collected from its SendFn. Rounds, duplicates, errors, resume,
// waiting limits and checkpoints.
#include "server/kv_server.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/compression/two_bit.h"
#include "common/hashed_spec.h"
#include "common/replica_chain.h"
#include "common/wire_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "tests/support/kv_messages.h"
#include "tests/support/server_harness.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

using testing::Floats;
using testing::Init;
using testing::KeyMessage;
using testing::Pull;
using testing::Push;
using testing::ServerHarness;
using testing::SetOptimizer;
using testing::SetTwoBit;

// The values of a reply that carries them in one frame.
std::vector<float> ValuesOf(const Message& m) {
  EXPECT_EQ(m.data.size(), 1u);
  return testing::ValuesOf(m);
}

absl::Status StatusOf(const Message& reply) {
  return FromWire(reply.header.status());
}

void ExpectOk(ServerHarness& h) {
  std::optional<Message> r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
}

std::vector<float> PullNow(ServerHarness& h, int rank, uint64_t key,
                           uint64_t length) {
  h.server().Handle(Pull(rank, key, length));
  std::optional<Message> r = h.NextReply();
  if (!r.has_value()) return {};
  EXPECT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
  return ValuesOf(*r);
}

// KV_INIT of dist_sync row key 12: 3 rows of 2 values, no value (zeros).
Message RowInit12() {
  Message init = KeyMessage(wire::KV_INIT, 0, 12, 6);
  init.header.mutable_slice()->set_row_length(2);
  init.header.mutable_kv_options()->set_sync_mode(true);
  return init;
}

// A push of `grad` as 2-bit codes of `threshold` (no residual before it).
Message TwoBitPush(int rank, uint64_t key, uint64_t seq,
                   const std::vector<float>& grad, float threshold) {
  std::vector<float> residual(grad.size(), 0.0f);
  Buffer packed =
      Buffer::Allocate(compression::TwoBitCompressedBytes(grad.size()));
  EXPECT_TRUE(compression::TwoBitQuantize(grad.data(), residual.data(),
                                          grad.size(), threshold,
                                          packed.mutable_data())
                  .ok());
  Message m = KeyMessage(wire::KV_PUSH, rank, key, grad.size());
  m.header.set_push_seq(seq);
  AddTwoBitFrame(&m, std::move(packed), grad.size());
  return m;
}

TEST(KVServerTest, SyncRoundIsAnsweredOnlyWhenEveryWorkerPushed) {
  ServerHarness h(/*num_workers=*/3);
  h.server().Handle(Init(7, {1, 1}));
  ExpectOk(h);
  h.server().Handle(Push(2, 7, 0, {3, 30}));
  h.server().Handle(Push(0, 7, 0, {1, 10}));
  EXPECT_EQ(h.Pending(), 0u) << "two of three pushed: nobody is answered";
  h.server().Handle(Push(1, 7, 0, {2, 20}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  // No optimizer: the value becomes the round's sum.
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{6, 60}));
  EXPECT_EQ(h.server().stats().rounds_applied(), 1u);
  EXPECT_EQ(h.server().stats().pushes_applied(), 3u);
}

// The pushes of a round arrive in any order (resends, reconnections,
// restarts); the value after the round is the same bits every time. Values
// span the float32 range and cancel, so a sum in arrival order would differ.
TEST(KVServerTest, RoundSumIsTheSameBitsInAnyArrivalOrder) {
  constexpr int kWorkers = 6;
  constexpr size_t kLength = 64;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> exponent(-140, 120);
  std::vector<std::vector<float>> pushes(kWorkers, std::vector<float>(kLength));
  for (size_t i = 0; i < kLength; ++i) {
    for (int w = 0; w < kWorkers; ++w) {
      pushes[w][i] = std::ldexp((w + i) % 2 ? 1.5f : -1.25f, exponent(rng));
    }
    pushes[kWorkers - 1][i] = -pushes[0][i];  // cancels exactly
  }
  std::vector<int> order(kWorkers);
  for (int w = 0; w < kWorkers; ++w) order[w] = w;
  std::vector<float> first;
  for (int trial = 0; trial < 30; ++trial) {
    std::shuffle(order.begin(), order.end(), rng);
    ServerHarness h(kWorkers);
    h.server().Handle(Init(1, std::vector<float>(kLength, 0.0f)));
    ExpectOk(h);
    for (int w : order) h.server().Handle(Push(w, 1, 0, pushes[w]));
    for (int w = 0; w < kWorkers; ++w) ExpectOk(h);
    const std::vector<float> got = PullNow(h, 0, 1, kLength);
    ASSERT_EQ(got.size(), kLength);
    if (trial == 0) {
      first = got;
      continue;
    }
    ASSERT_EQ(std::memcmp(got.data(), first.data(), kLength * sizeof(float)), 0)
        << "trial " << trial;
  }
}

TEST(KVServerTest, ArrivalModeSumsInFloat32) {
  ServerHarness h(/*num_workers=*/3, /*threads=*/1, WaitingLimits(),
                  SyncRound::Mode::kArrival);
  h.server().Handle(Init(2, {0, 0}));
  ExpectOk(h);
  h.server().Handle(Push(1, 2, 0, {2, 20}));
  h.server().Handle(Push(0, 2, 0, {1, 10}));
  h.server().Handle(Push(2, 2, 0, {3, 30}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 2, 2), (std::vector<float>{6, 60}));
  // Arrival order shows in the last bits: 1e8 + 1 - 1e8 is 0 in float32 when
  // the big values come first.
  h.server().Handle(Push(0, 2, 1, {1e8f, 1}));
  h.server().Handle(Push(2, 2, 1, {-1e8f, 1}));
  h.server().Handle(Push(1, 2, 1, {1, 1}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 2, 2), (std::vector<float>{1, 3}));
  h.server().Handle(Push(0, 2, 2, {1e8f, 1}));
  h.server().Handle(Push(1, 2, 2, {1, 1}));
  h.server().Handle(Push(2, 2, 2, {-1e8f, 1}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 2, 2), (std::vector<float>{0, 3}));
}

TEST(KVServerTest, PullAfterOwnPushWaitsForTheRound) {
  ServerHarness h(/*num_workers=*/2);
  h.server().Handle(Init(1, {0}));
  ExpectOk(h);
  h.server().Handle(SetOptimizer("sgd lr=-2"));
  std::optional<Message> refused = h.NextReply();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(StatusOf(*refused).code(), absl::StatusCode::kFailedPrecondition)
      << "the optimizer comes before keys";
  h.server().Handle(Push(0, 1, 0, {5}));
  h.server().Handle(Pull(0, 1, 1));  // sees this round's result
  EXPECT_EQ(h.Pending(), 0u);
  EXPECT_EQ(PullNow(h, 1, 1, 1), (std::vector<float>{0}))
      << "worker 1 has not pushed: it sees the old value";
  h.server().Handle(Push(1, 1, 0, {7}));
  std::vector<float> pulled;
  for (int i = 0; i < 3; ++i) {
    std::optional<Message> r = h.NextReply();
    ASSERT_TRUE(r.has_value());
    if (r->header.command() == wire::KV_PULL) pulled = ValuesOf(*r);
  }
  EXPECT_EQ(pulled, (std::vector<float>{12}));
}

// A pull says how many pushes its worker made to the key before it; one that
// overtook them (resent to a restarted server before the replay) waits for
// them and then answers with their result, never with older weights.
TEST(KVServerTest, PullThatOvertookItsWorkersPushesWaitsForThem) {
  for (const bool sync : {true, false}) {
    SCOPED_TRACE(sync ? "dist_sync" : "dist_async");
    ServerHarness h(/*num_workers=*/1);
    if (!sync) {  // dist_async applies each push with the servers' optimizer
      h.server().Handle(SetOptimizer("sgd lr=-1"));
      ExpectOk(h);
    }
    h.server().Handle(Init(6, {1}, sync));
    ExpectOk(h);
    Message pull = Pull(0, 6, 1);
    pull.header.set_push_seq(2);  // after two pushes
    h.server().Handle(std::move(pull));
    EXPECT_EQ(h.Pending(), 0u) << "no push taken yet: the pull waits";
    h.server().Handle(Push(0, 6, 0, {10}));
    ExpectOk(h);
    EXPECT_EQ(h.Pending(), 0u) << "one of two pushes taken: still waiting";
    h.server().Handle(Push(0, 6, 1, {20}));
    std::vector<float> pulled;
    for (int i = 0; i < 2; ++i) {
      std::optional<Message> r = h.NextReply();
      ASSERT_TRUE(r.has_value());
      EXPECT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
      if (r->header.command() == wire::KV_PULL) pulled = ValuesOf(*r);
    }
    // Sync without an optimizer: the value is the last round's sum; async
    // with sgd lr=-1 adds each push.
    EXPECT_EQ(pulled, (std::vector<float>{sync ? 20.0f : 31.0f}));
    // A pull that asks for no more than was taken is answered at once.
    Message now = Pull(0, 6, 1);
    now.header.set_push_seq(2);
    h.server().Handle(std::move(now));
    std::optional<Message> r = h.NextReply();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(ValuesOf(*r), pulled);
  }
}

// A pull waiting for its own pushes does not keep them waiting behind it:
// (a) a push that overtook a missing one queued behind the pull, then the
// missing one; (b) on a restarted server, the pull and the pushes all held
// for a key the replay has not re-created yet (adopted by the init).
TEST(KVServerTest, APullWaitingForItsPushesLetsThemPass) {
  auto answers = [](ServerHarness& h, int n) {
    std::vector<float> pulled;
    int pushes = 0;
    for (int i = 0; i < n; ++i) {
      std::optional<Message> r = h.NextReply();
      if (!r.has_value()) {
        ADD_FAILURE() << "reply " << i << " of " << n << " never came";
        return std::make_pair(pushes, pulled);
      }
      EXPECT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
      if (r->header.command() == wire::KV_PULL) {
        pulled = ValuesOf(*r);
      } else {
        ++pushes;
      }
    }
    return std::make_pair(pushes, pulled);
  };
  {
    SCOPED_TRACE("pull, then push 1 (ahead), then push 0");
    ServerHarness h(/*num_workers=*/1);
    h.server().Handle(Init(8, {1}));
    ExpectOk(h);
    Message pull = Pull(0, 8, 1);
    pull.header.set_push_seq(2);
    h.server().Handle(std::move(pull));
    h.server().Handle(Push(0, 8, 1, {20}));
    EXPECT_EQ(h.Pending(), 0u);
    h.server().Handle(Push(0, 8, 0, {10}));
    // One worker: each push is a round; the value is the last round's sum.
    EXPECT_EQ(answers(h, 3), std::make_pair(2, std::vector<float>{20}));
  }
  {
    SCOPED_TRACE("restarted server: pull and pushes before the init");
    ServerHarness h(/*num_workers=*/1);
    h.server().set_recovering();
    Message pull = Pull(0, 9, 1);
    pull.header.set_push_seq(2);
    h.server().Handle(std::move(pull));
    h.server().Handle(Push(0, 9, 0, {10}));
    h.server().Handle(Push(0, 9, 1, {20}));
    // The key is not there yet: all three wait, acknowledged.
    for (int i = 0; i < 3; ++i) {
      std::optional<Message> ack = h.NextReply(/*skip_acks=*/false);
      ASSERT_TRUE(ack.has_value());
      EXPECT_TRUE(ack->header.ack_only()) << DebugString(*ack);
    }
    h.server().Handle(Init(9, {1}));
    EXPECT_EQ(answers(h, 4), std::make_pair(3, std::vector<float>{20}));
  }
}

// A worker's push in flight when its server died is resent by the worker's
// resend thread and can reach the restarted server (ZeroMQ reconnects to the
// same port) before the worker learns of the restart and replays the earlier
// pushes. Held before the init, the overtaking push came first in the queue;
// it must not block the replayed ones that fill the gap (fault_test's
// intermittent hang: a round waiting for ever for that worker).
TEST(KVServerTest,
     ARestartedServerTakesReplayedPushesBehindOneThatOvertookThem) {
  ServerHarness h(/*num_workers=*/2);
  h.server().set_recovering();
  h.server().Handle(Push(1, 5, 2, {300}));  // the resent one, first
  for (uint64_t seq = 0; seq < 3; ++seq) {
    if (seq < 2) h.server().Handle(Push(1, 5, seq, {100.0f * (seq + 1)}));
    h.server().Handle(Push(0, 5, seq, {10.0f * (seq + 1)}));
  }
  for (int i = 0; i < 6; ++i) {
    std::optional<Message> ack = h.NextReply(/*skip_acks=*/false);
    ASSERT_TRUE(ack.has_value());
    EXPECT_TRUE(ack->header.ack_only()) << DebugString(*ack);
  }
  h.server().Handle(Init(5, {1}));
  ExpectOk(h);  // the init
  // Three rounds, each answered to both workers.
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE(i);
    ExpectOk(h);
  }
  EXPECT_EQ(h.server().stats().rounds_applied(), 3u);
  // No optimizer: the value is the last round's sum.
  EXPECT_EQ(PullNow(h, 0, 5, 1), (std::vector<float>{330}));
}

TEST(KVServerTest, ResentPushIsAnsweredAndNotAppliedTwice) {
  ServerHarness h(/*num_workers=*/1);
  h.server().Handle(SetOptimizer("sgd lr=-1"));
  ExpectOk(h);
  h.server().Handle(Init(3, {10}, /*sync=*/false));
  ExpectOk(h);
  Message push = Push(0, 3, 0, {1});
  Message resent = push;
  h.server().Handle(std::move(push));
  ExpectOk(h);
  h.server().Handle(std::move(resent));
  ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 3, 1), (std::vector<float>{11}));
  EXPECT_EQ(h.server().stats().duplicates(), 1u);
  EXPECT_EQ(h.server().stats().pushes_applied(), 1u);
}

// The header of `push` marked as a probe, without its frames (what a worker
// resends once the server acknowledged the push, issue #46).
Message ProbeOf(const Message& push) {
  Message probe;
  probe.header = push.header;
  probe.header.clear_frames();
  probe.header.set_probe(true);
  return probe;
}

// A probe for a push the server holds (in the open round, or waiting behind
// a missing one) is acknowledged; for one it took, answered as its resent
// copy would be. Never applied: the round's sum has each push once.
TEST(KVServerTest, AProbeForAPushTheServerHoldsIsAcknowledgedNotApplied) {
  ServerHarness h(/*num_workers=*/2);
  h.server().Handle(Init(3, {0, 0}));
  ExpectOk(h);
  Message push = Push(0, 3, 0, {1, 2});
  const uint64_t id = push.header.request_id();
  h.server().Handle(Message(push));
  EXPECT_EQ(h.Pending(), 0u) << "held for its round";
  h.server().Handle(ProbeOf(push));
  std::optional<Message> ack = h.NextReply(/*skip_acks=*/false);
  ASSERT_TRUE(ack.has_value());
  EXPECT_TRUE(ack->header.ack_only());
  EXPECT_FALSE(ack->header.send_whole());
  EXPECT_EQ(ack->header.request_id(), id);

  // Worker 0's push 2 overtook its push 1: it waits, and so does its probe's
  // answer (an acknowledgement).
  Message ahead = Push(0, 3, 2, {100, 100});
  h.server().Handle(Message(ahead));
  h.server().Handle(ProbeOf(ahead));
  ack = h.NextReply(/*skip_acks=*/false);
  ASSERT_TRUE(ack.has_value());
  EXPECT_TRUE(ack->header.ack_only());
  EXPECT_EQ(ack->header.request_id(), ahead.header.request_id());

  h.server().Handle(Push(1, 3, 0, {10, 20}));  // completes round 0
  for (int i = 0; i < 2; ++i) {
    std::optional<Message> r = h.NextReply();
    ASSERT_TRUE(r.has_value());
    EXPECT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
    EXPECT_FALSE(r->header.send_whole());
  }
  EXPECT_EQ(h.server().stats().pushes_applied(), 2u);
  // After its round: answered at once, not applied again.
  h.server().Handle(ProbeOf(push));
  std::optional<Message> r = h.NextReply(/*skip_acks=*/false);
  ASSERT_TRUE(r.has_value());
  EXPECT_FALSE(r->header.ack_only());
  EXPECT_FALSE(r->header.send_whole());
  EXPECT_EQ(r->header.request_id(), id);
  EXPECT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
  EXPECT_EQ(h.server().stats().pushes_applied(), 2u);
  EXPECT_EQ(h.server().stats().rounds_applied(), 1u);
  EXPECT_EQ(PullNow(h, 1, 3, 2), (std::vector<float>{11, 22}));
}

// A probe for a push the server does not hold (it lost it: a restart the
// worker has not heard of) is answered send_whole and changes nothing; the
// whole push then takes its place in the round, whose sum is exact. A probe
// for a slice the server does not hold is answered the same way.
TEST(KVServerTest, AProbeForAPushTheServerLacksIsAnsweredSendWhole) {
  ServerHarness h(/*num_workers=*/3);
  h.server().Handle(Init(5, {0}));
  ExpectOk(h);
  h.server().Handle(Push(1, 5, 0, {1e8f}));
  Message lost = Push(0, 5, 0, {1});
  h.server().Handle(ProbeOf(lost));
  std::optional<Message> r = h.NextReply(/*skip_acks=*/false);
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->header.send_whole());
  EXPECT_FALSE(r->header.ack_only());
  EXPECT_EQ(r->header.request_id(), lost.header.request_id());
  EXPECT_EQ(h.Pending(), 0u) << "the round is not complete";
  EXPECT_EQ(h.server().stats().pushes_applied(), 1u);

  h.server().Handle(std::move(lost));  // sent whole
  h.server().Handle(Push(2, 5, 0, {-1e8f}));
  for (int i = 0; i < 3; ++i) {
    r = h.NextReply();
    ASSERT_TRUE(r.has_value());
    EXPECT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
    EXPECT_FALSE(r->header.send_whole());
  }
  EXPECT_EQ(h.server().stats().pushes_applied(), 3u);
  // 1e8 + 1 - 1e8 in float32 in arrival order is 0; the exact sum is 1.
  EXPECT_EQ(PullNow(h, 0, 5, 1), (std::vector<float>{1}));

  h.server().Handle(ProbeOf(Push(0, 77, 0, {1})));  // never initialised
  r = h.NextReply(/*skip_acks=*/false);
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->header.send_whole());
}

TEST(KVServerTest, PushThatOvertookAnEarlierOneWaitsForItWithoutDeadlock) {
  ServerHarness h(/*num_workers=*/1);
  h.server().Handle(Init(4, {0}));
  ExpectOk(h);
  h.server().Handle(Push(0, 4, 1, {2}));  // push 0 was lost
  EXPECT_EQ(h.Pending(), 0u);
  h.server().Handle(Push(0, 4, 0, {1}));  // its resend
  ExpectOk(h);
  ExpectOk(h);
  // Rounds in push order: the value is push 1's (the last round's sum).
  EXPECT_EQ(PullNow(h, 0, 4, 1), (std::vector<float>{2}));
  EXPECT_EQ(h.server().stats().rounds_applied(), 2u);
}

TEST(KVServerTest, ErrorsAreRepliesAndChangeNothing) {
  ServerHarness h(/*num_workers=*/1);
  h.server().Handle(Pull(0, 99, 3));
  std::optional<Message> r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(StatusOf(*r).code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(StatusOf(*r).message()),
              HasSubstr("key 99 was never initialised"));
  h.server().Handle(Init(5, {1, 2, 3}, /*sync=*/false));
  ExpectOk(h);
  h.server().Handle(Push(0, 5, 0, {1, 2}));  // wrong length
  r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(StatusOf(*r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(r->header.push_untaken()) << "the worker must learn it";
  // Refused before it was numbered: the next push is still number 0.
  h.server().Handle(Push(0, 5, 0, {1, 1, 1}));  // async, no optimizer
  r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(StatusOf(*r).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StatusOf(*r).message(),
            "dist_async needs an optimizer on the servers: call "
            "set_optimizer before pushing");
  // Refused after its number was taken: it counts, and its worker is in
  // step (its next push is number 1).
  EXPECT_FALSE(r->header.push_untaken());
  EXPECT_EQ(PullNow(h, 0, 5, 3), (std::vector<float>{1, 2, 3}));
  // A bad 2-bit payload (a 0b01 code) is DataLoss and nothing is applied.
  Message bad = KeyMessage(wire::KV_PUSH, 0, 5, 3);
  bad.header.set_push_seq(1);
  AddTwoBitFrame(&bad, Buffer::CopyOf("\x40\0\0\0", 4), 3);
  h.server().Handle(std::move(bad));
  r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(StatusOf(*r).code(), absl::StatusCode::kInvalidArgument)
      << "2-bit without compression set: " << StatusOf(*r);
  EXPECT_TRUE(r->header.push_untaken());
  EXPECT_EQ(PullNow(h, 0, 5, 3), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(h.server().stats().pushes_applied(), 0u);
}

TEST(KVServerTest, RejoinSaysWherePushesResumeAndDropsTheEarlierLife) {
  ServerHarness h(/*num_workers=*/2);
  h.server().Handle(Init(6, {0}));
  ExpectOk(h);
  for (uint64_t seq = 0; seq < 3; ++seq) {
    h.server().Handle(Push(0, 6, seq, {1}));
    h.server().Handle(Push(1, 6, seq, {1}));
    ExpectOk(h);
    ExpectOk(h);
  }
  // Worker 1's earlier life left a push waiting (its seq 4: 3 is missing).
  h.server().Handle(Push(1, 6, 4, {100}));
  EXPECT_EQ(h.Pending(), 0u);
  Message rejoin = KeyMessage(wire::KV_INIT, 1, 6, 1);
  rejoin.header.set_rejoin(true);
  rejoin.header.set_generation(1);
  h.server().Handle(std::move(rejoin));
  std::optional<Message> r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(StatusOf(*r).ok());
  EXPECT_EQ(r->header.push_seq(), 3u) << "three pushes of rank 1 were taken";
  // The new life pushes round 3; the dropped push 4 never counts.
  Message again = Push(1, 6, 3, {2});
  again.header.set_generation(1);
  h.server().Handle(std::move(again));
  h.server().Handle(Push(0, 6, 3, {2}));
  ExpectOk(h);
  ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 6, 1), (std::vector<float>{4}));
  EXPECT_EQ(h.Pending(), 0u);
}

TEST(KVServerTest, TooManyWaitingRequestsAreRefusedNamingTheKey) {
  WaitingLimits limits;
  limits.max_messages_per_sender = 4;
  ServerHarness h(/*num_workers=*/2, /*threads=*/1, limits);
  h.server().Handle(Init(8, {0, 0}));
  ExpectOk(h);
  // Rank 1 runs far ahead: pushes numbered 100.. wait for the missing ones.
  for (uint64_t seq = 100; seq < 110; ++seq)
    h.server().Handle(Push(1, 8, seq, {1, 1}));
  int refused = 0;
  for (int i = 0; i < 6; ++i) {
    std::optional<Message> r = h.NextReply();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(StatusOf(*r).code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(StatusOf(*r).message()), HasSubstr("key 8"));
    EXPECT_TRUE(r->header.push_untaken()) << "never taken";
    ++refused;
  }
  EXPECT_EQ(refused, 6);
  EXPECT_EQ(h.server().stats().refused(), 6u);
  // Rank 0 is still served.
  EXPECT_EQ(PullNow(h, 0, 8, 2), (std::vector<float>{0, 0}));
}

// A dist_ssp pushpull applied, its answer held for the bound: when it
// cannot be held (its worker's limit), the refusal says it was taken (its
// worker is in step; the push counts).
TEST(KVServerTest, ATakenPushThatCannotBeHeldIsNotRefusedAsUntaken) {
  WaitingLimits limits;
  limits.max_messages_per_sender = 1;
  ServerHarness h(/*num_workers=*/2, /*threads=*/1, limits);
  h.server().Handle(SetOptimizer("sgd lr=1"));
  ExpectOk(h);
  Message ssp = Init(9, {0}, /*sync=*/false);
  ssp.header.mutable_kv_options()->set_bounded_staleness(true);
  ssp.header.mutable_kv_options()->set_staleness(0);
  h.server().Handle(std::move(ssp));
  ExpectOk(h);
  h.server().Handle(Push(0, 9, 5, {1}));  // pushes 0 to 4 missing: held
  EXPECT_EQ(h.Pending(), 0u);
  Message pushpull = Push(0, 9, 0, {1});
  pushpull.header.set_command(wire::KV_PUSHPULL);
  h.server().Handle(std::move(pushpull));
  std::optional<Message> r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(StatusOf(*r).code(), absl::StatusCode::kResourceExhausted)
      << StatusOf(*r);
  EXPECT_EQ(StatusOf(*r).message(),
            absl::StrCat("key 9: node ", WorkerId(0),
                         " already has 1 requests waiting on this server (at "
                         "most 1); is it running far ahead of the other "
                         "workers?"));
  EXPECT_FALSE(r->header.push_untaken()) << "it was taken";
  EXPECT_EQ(h.server().stats().pushes_applied(), 1u);
}

// The codes of a 2-bit push are checked before its number is taken (like
// its frames): a push whose payload does not decode leaves the worker's
// count as it was, and the correct push of the same number is taken, not
// answered as a copy of one taken before.
TEST(KVServerTest, ATwoBitPushThatDoesNotDecodeLeavesItsNumberToTheCorrectOne) {
  ServerHarness h(/*num_workers=*/2);
  h.server().Handle(SetTwoBit(0.5f));
  ExpectOk(h);
  h.server().Handle(Init(8, {0, 0, 0}));
  ExpectOk(h);
  // Element 0's code is 0b01, which no encoder emits.
  Message bad = KeyMessage(wire::KV_PUSH, 0, 8, 3);
  bad.header.set_push_seq(0);
  AddTwoBitFrame(&bad, Buffer::CopyOf("\x40\0\0\0", 4), 3);
  h.server().Handle(std::move(bad));
  std::optional<Message> r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(StatusOf(*r).code(), absl::StatusCode::kDataLoss) << StatusOf(*r);
  EXPECT_EQ(StatusOf(*r).message(),
            "push of key 8: 2-bit payload holds the invalid code 0b01 at "
            "slot 0");
  EXPECT_TRUE(r->header.push_untaken());
  EXPECT_EQ(h.server().stats().malformed_messages(), 1u);
  // The correct push, number 0 still: in the open round, which waits for
  // worker 1.
  h.server().Handle(TwoBitPush(0, 8, 0, {0.6f, -0.7f, 0.1f}, 0.5f));
  EXPECT_EQ(h.Pending(), 0u) << "answered as a copy of a push taken before";
  h.server().Handle(TwoBitPush(1, 8, 0, {0.6f, 0.6f, 0.6f}, 0.5f));
  ExpectOk(h);
  ExpectOk(h);
  // No optimizer: the value is the round's sum of the decoded codes.
  EXPECT_EQ(PullNow(h, 0, 8, 3), (std::vector<float>{1.0f, 0.0f, 0.5f}));
  EXPECT_EQ(h.server().stats().rounds_applied(), 1u);
  EXPECT_EQ(h.server().stats().pushes_applied(), 2u);
}

TEST(KVServerTest, SnapshotExcludesTheOpenRoundAndRestoresExactly) {
  ServerHarness h(/*num_workers=*/2);
  h.server().Handle(SetOptimizer("sgd lr=0.5 momentum=0.9"));
  ExpectOk(h);
  h.server().Handle(Init(9, {1, 2, 3}));
  ExpectOk(h);
  h.server().Handle(Push(0, 9, 0, {1, 1, 1}));
  h.server().Handle(Push(1, 9, 0, {1, 2, 3}));
  ExpectOk(h);
  ExpectOk(h);
  h.server().Handle(Push(0, 9, 1, {4, 4, 4}));  // round 1 open
  absl::Mutex mu;
  std::optional<wire::ServerCheckpoint> saved;
  h.server().Snapshot([&](wire::ServerCheckpoint shard) {
    absl::MutexLock lock(&mu);
    saved = std::move(shard);
  });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](std::optional<wire::ServerCheckpoint>* s) {
          return s->has_value();
        },
        &saved));
  }
  ASSERT_EQ(saved->keys_size(), 1);
  const wire::CheckpointKey& k = saved->keys(0);
  EXPECT_EQ(k.steps(), 1u);
  EXPECT_EQ(k.rounds(), 1u) << "rounds completed: a joiner's entry counts them";
  EXPECT_EQ(k.received(0), 1u) << "its push of the open round is not in it";
  EXPECT_EQ(k.received(1), 1u);
  EXPECT_THAT(saved->optimizer_spec(), HasSubstr("lr=0.5"));
  EXPECT_THAT(saved->optimizer_spec(), HasSubstr("momentum=0.9"));

  ServerHarness restored(/*num_workers=*/2);
  ASSERT_TRUE(restored.server().Restore(*saved).ok());
  // Both servers finish round 1 the same way; same bits.
  Message replay = Push(0, 9, 1, {4, 4, 4});
  restored.server().Handle(std::move(replay));
  restored.server().Handle(Push(1, 9, 1, {0, 1, 0}));
  h.server().Handle(Push(1, 9, 1, {0, 1, 0}));
  for (int i = 0; i < 2; ++i) {
    ExpectOk(h);
    ExpectOk(restored);
  }
  EXPECT_EQ(PullNow(h, 0, 9, 3), PullNow(restored, 0, 9, 3));
}

// A message of key `key` (`length` rows of 2 on this server) naming rows:
// ids, then for a push their values.
Message IdsMessage(wire::Command cmd, int rank, uint64_t key, uint64_t length,
                   uint64_t seq, const std::vector<uint64_t>& ids,
                   const std::vector<float>& values) {
  Message m = KeyMessage(cmd, rank, key, length);
  m.header.mutable_slice()->set_row_length(2);
  m.header.set_push_seq(seq);
  wire::DataFrame* d = m.header.add_frames();
  d->set_encoding(wire::DataFrame::RAW);
  d->set_num_bytes(ids.size() * 8);
  m.data.push_back(Buffer::CopyOf(ids.data(), ids.size() * 8));
  if (cmd == wire::KV_PUSH) AddFloatFrame(&m, Floats(values));
  return m;
}

// A row-sparse key: 6 rows of 2 on this server.
Message RowMessage(wire::Command cmd, int rank, uint64_t seq,
                   const std::vector<uint64_t>& ids,
                   const std::vector<float>& values) {
  return IdsMessage(cmd, rank, 12, 6, seq, ids, values);
}

TEST(KVServerTest, RowKeySnapshotWithAnOpenRoundRestoresBitForBit) {
  ServerHarness h(/*num_workers=*/2);
  h.server().Handle(SetOptimizer("adam lr=0.1"));
  ExpectOk(h);
  h.server().Handle(RowInit12());  // no value: zeros
  ExpectOk(h);
  h.server().Handle(RowMessage(wire::KV_PUSH, 0, 0, {1, 4}, {1, 2, 3, 4}));
  h.server().Handle(RowMessage(wire::KV_PUSH, 1, 0, {4}, {5, 6}));
  ExpectOk(h);
  ExpectOk(h);
  h.server().Handle(RowMessage(wire::KV_PUSH, 0, 1, {2}, {7, 8}));  // open
  absl::Mutex mu;
  std::optional<wire::ServerCheckpoint> saved;
  h.server().Snapshot([&](wire::ServerCheckpoint shard) {
    absl::MutexLock lock(&mu);
    saved = std::move(shard);
  });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](std::optional<wire::ServerCheckpoint>* s) {
          return s->has_value();
        },
        &saved));
  }
  ASSERT_EQ(saved->keys_size(), 1);
  EXPECT_EQ(saved->keys(0).row_length(), 2u);
  EXPECT_EQ(saved->keys(0).received(0), 1u)
      << "the open round's push is not in it";
  ServerHarness restored(/*num_workers=*/2);
  ASSERT_TRUE(restored.server().Restore(*saved).ok());
  restored.server().Handle(RowMessage(wire::KV_PUSH, 0, 1, {2}, {7, 8}));
  for (ServerHarness* s : {&h, &restored}) {
    s->server().Handle(RowMessage(wire::KV_PUSH, 1, 1, {4, 2}, {1, 1, 1, 1}));
    ExpectOk(*s);
    ExpectOk(*s);
  }
  std::vector<std::vector<float>> pulled;
  for (ServerHarness* s : {&h, &restored}) {
    s->server().Handle(RowMessage(wire::KV_PULL, 0, 0, {0, 1, 2, 3, 4, 5}, {}));
    std::optional<Message> r = s->NextReply();
    ASSERT_TRUE(r.has_value());
    ASSERT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
    pulled.push_back(ValuesOf(*r));
  }
  ASSERT_EQ(pulled[0].size(), 12u);
  EXPECT_EQ(std::memcmp(pulled[0].data(), pulled[1].data(), 48), 0);
  EXPECT_EQ(pulled[0][0], 0.0f) << "row 0 never had a gradient";
  EXPECT_EQ(pulled[0][6], 0.0f);
  EXPECT_NE(pulled[0][8], 0.0f);
}

// A hashed key (key 31, rows of 2; offset, length and total 0).
Message HashedMessage(wire::Command cmd, int rank, uint64_t seq,
                      const std::vector<uint64_t>& ids,
                      const std::vector<float>& values) {
  return IdsMessage(cmd, rank, 31, 0, seq, ids, values);
}

// A hashed key's table, its recency order and its admission counts survive
// a checkpoint with a round open: the restored server and the original, fed
// the same pushes after it, answer every pull with the same bits, and an id
// seen once before the checkpoint is admitted at its second push after it.
TEST(KVServerTest, HashedKeySnapshotRestoresTheTableAndItsCountsBitForBit) {
  ServerHarness h(/*num_workers=*/2);
  h.server().Handle(SetOptimizer("adam lr=0.1"));
  ExpectOk(h);
  Message init = KeyMessage(wire::KV_INIT, 0, 31, 0);
  init.header.mutable_slice()->set_row_length(2);
  init.header.mutable_slice()->set_hashed_spec(
      "init=uniform low=-1 high=1 seed=4 admit_after=2 capacity=3");
  init.header.mutable_kv_options()->set_sync_mode(true);
  Message again = init;
  h.server().Handle(std::move(init));
  ExpectOk(h);
  // The same init again (a resend) is fine; other options are refused.
  h.server().Handle(Message(again));
  ExpectOk(h);
  again.header.mutable_slice()->set_hashed_spec("capacity=4");
  h.server().Handle(std::move(again));
  {
    std::optional<Message> r = h.NextReply();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(StatusOf(*r).code(), absl::StatusCode::kAlreadyExists);
    EXPECT_THAT(std::string(StatusOf(*r).message()),
                ::testing::HasSubstr("exists with options"));
  }
  const uint64_t big = uint64_t{1} << 60;
  // Round 1: 7 named by both pushes (admitted), big by one (dropped).
  h.server().Handle(HashedMessage(wire::KV_PUSH, 0, 0, {big, 7}, {1, 2, 3, 4}));
  h.server().Handle(HashedMessage(wire::KV_PUSH, 1, 0, {7}, {5, 6}));
  ExpectOk(h);
  ExpectOk(h);
  h.server().Handle(HashedMessage(wire::KV_PUSH, 0, 1, {99}, {7, 8}));  // open
  absl::Mutex mu;
  std::optional<wire::ServerCheckpoint> saved;
  h.server().Snapshot([&](wire::ServerCheckpoint shard) {
    absl::MutexLock lock(&mu);
    saved = std::move(shard);
  });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](std::optional<wire::ServerCheckpoint>* s) {
          return s->has_value();
        },
        &saved));
  }
  ASSERT_EQ(saved->keys_size(), 1);
  ASSERT_TRUE(saved->keys(0).has_hashed());
  EXPECT_EQ(saved->keys(0).hashed().ids_size(), 1) << "7 alone has a row";
  EXPECT_EQ(saved->keys(0).hashed().dropped(), 1u);
  ServerHarness restored(/*num_workers=*/2);
  ASSERT_TRUE(restored.server().Restore(*saved).ok());
  restored.server().Handle(HashedMessage(wire::KV_PUSH, 0, 1, {99}, {7, 8}));
  for (ServerHarness* s : {&h, &restored}) {
    // Round 2: big's second push (admitted now), 99 once so far, 5 new.
    s->server().Handle(
        HashedMessage(wire::KV_PUSH, 1, 1, {big, 5}, {1, 1, 2, 2}));
    ExpectOk(*s);
    ExpectOk(*s);
  }
  std::vector<std::vector<float>> pulled;
  for (ServerHarness* s : {&h, &restored}) {
    s->server().Handle(
        HashedMessage(wire::KV_PULL, 0, 0, {7, big, 99, 5, 12345}, {}));
    std::optional<Message> r = s->NextReply();
    ASSERT_TRUE(r.has_value());
    ASSERT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
    pulled.push_back(ValuesOf(*r));
  }
  ASSERT_EQ(pulled[0].size(), 10u);
  EXPECT_EQ(std::memcmp(pulled[0].data(), pulled[1].data(), 40), 0);
  const HashedSpec spec =
      *HashedSpec::Parse("init=uniform low=-1 high=1 seed=4");
  // 99 and 5 were named once each: no rows, their initial rows.
  EXPECT_EQ(pulled[0][4], spec.InitialValue(99, 0));
  EXPECT_EQ(pulled[0][6], spec.InitialValue(5, 0));
  EXPECT_EQ(pulled[0][8], spec.InitialValue(12345, 0));
  // big was admitted in round 2: Adam moved it from its initial row.
  EXPECT_NE(pulled[0][2], spec.InitialValue(big, 0));
}

// Checkpoint writes held 3 s, as on a slow disk: pushes keep being answered.
// Row-sparse and hashed pushes are checked before their number is taken
// too (row ids, frames, 2-bit codes): a malformed push leaves its number to
// the correct one, which is applied, not answered as a copy of one taken
// before.
TEST(KVServerTest, AMalformedRowOrHashedPushLeavesItsNumberToTheCorrectOne) {
  ServerHarness h(/*num_workers=*/1);
  h.server().Handle(SetTwoBit(0.5f));
  ExpectOk(h);
  h.server().Handle(RowInit12());  // no value: zeros
  ExpectOk(h);
  Message hashed = KeyMessage(wire::KV_INIT, 0, 31, 0);
  hashed.header.mutable_slice()->set_row_length(2);
  hashed.header.mutable_kv_options()->set_sync_mode(true);
  h.server().Handle(std::move(hashed));  // rows start at zeros
  ExpectOk(h);
  auto expect_untaken = [&h](absl::StatusCode code, const std::string& why) {
    std::optional<Message> r = h.NextReply();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(StatusOf(*r).code(), code) << StatusOf(*r);
    EXPECT_EQ(StatusOf(*r).message(), why);
    EXPECT_TRUE(r->header.push_untaken()) << why;
  };
  h.server().Handle(RowMessage(wire::KV_PUSH, 0, 0, {1, 6}, {1, 2, 3, 4}));
  expect_untaken(absl::StatusCode::kInvalidArgument,
                 "key 12: row id 6 is past its 6 rows");
  Message codes = RowMessage(wire::KV_PUSH, 0, 0, {1, 4}, {});
  codes.data.pop_back();
  codes.header.mutable_frames()->RemoveLast();
  // Element 0's code is 0b01, which no encoder emits.
  AddTwoBitFrame(&codes, Buffer::CopyOf("\x40\0\0\0", 4), 4);
  h.server().Handle(std::move(codes));
  expect_untaken(absl::StatusCode::kDataLoss,
                 "row push of key 12: 2-bit payload holds the invalid code "
                 "0b01 at slot 0");
  Message ids = HashedMessage(wire::KV_PUSH, 0, 0, {5}, {1, 2});
  ids.data[0] = Buffer::CopyOf("\5\0\0\0\0\0\0", 7);
  ids.header.mutable_frames(0)->set_num_bytes(7);
  h.server().Handle(std::move(ids));
  expect_untaken(absl::StatusCode::kInvalidArgument,
                 "call of hashed key 31: its first frame must hold the ids "
                 "(uint64)");
  EXPECT_EQ(h.server().stats().malformed_messages(), 1u);
  // The correct pushes, number 0 still: each completes its key's round.
  h.server().Handle(RowMessage(wire::KV_PUSH, 0, 0, {1, 4}, {1, 2, 3, 4}));
  ExpectOk(h);
  h.server().Handle(HashedMessage(wire::KV_PUSH, 0, 0, {5}, {5, 6}));
  ExpectOk(h);
  // No optimizer: the rows pushed become the round's sum.
  h.server().Handle(RowMessage(wire::KV_PULL, 0, 1, {1, 4}, {}));
  std::optional<Message> r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(ValuesOf(*r), (std::vector<float>{1, 2, 3, 4}));
  h.server().Handle(HashedMessage(wire::KV_PULL, 0, 1, {5}, {}));
  r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(ValuesOf(*r), (std::vector<float>{5, 6}));
  EXPECT_EQ(h.server().stats().pushes_applied(), 2u);
  EXPECT_EQ(h.server().stats().rounds_applied(), 2u);
}

TEST(KVServerTest, SlowCheckpointDoesNotStallTraffic) {
  ServerHarness h(/*num_workers=*/1);
  h.server().Handle(Init(2, std::vector<float>(1000, 1.0f), /*sync=*/true));
  ExpectOk(h);
  char dir[] = "/tmp/tessera-ckpt-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  CheckpointStore store(dir, 0, 2);
  CheckpointPolicy every_update;
  every_update.every_updates = 1;
  Checkpointer checkpointer(&store, every_update, &h.server(),
                            /*write_delay=*/absl::Seconds(3));
  h.server().Handle(Push(0, 2, 0, std::vector<float>(1000, 1.0f)));
  ExpectOk(h);
  checkpointer.MaybeWrite();  // starts a write that takes 3 s
  const absl::Time start = absl::Now();
  for (uint64_t seq = 1; seq <= 50; ++seq) {
    checkpointer.MaybeWrite();
    h.server().Handle(Push(0, 2, seq, std::vector<float>(1000, 1.0f)));
    ExpectOk(h);
  }
  // 50 pushes answered while the checkpoint was still being written.
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_TRUE(checkpointer.busy());
  EXPECT_EQ(store.List().size(), 0u);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (store.List().empty() && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  ASSERT_EQ(store.List().size(), 1u);
  absl::StatusOr<wire::ServerCheckpoint> on_disk =
      CheckpointStore::ReadFile(store.List()[0]);
  ASSERT_TRUE(on_disk.ok()) << on_disk.status();
  EXPECT_EQ(on_disk->keys(0).received(0), 1u)
      << "the snapshot was taken when it was asked for";
  std::filesystem::remove_all(dir);
}

// A write that takes longer than a second says so while it runs (from the
// next MaybeWrite) and when it ends; a fast one is not logged.
TEST(KVServerTest, SlowCheckpointWriteIsLoggedWithItsSizeAndDuration) {
  ServerHarness h(/*num_workers=*/1);
  h.server().Handle(Init(2, std::vector<float>(250000, 1.0f), /*sync=*/true));
  ExpectOk(h);
  char dir[] = "/tmp/tessera-ckpt-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  CheckpointStore store(dir, 0, 2);
  CheckpointPolicy every_update;
  every_update.every_updates = 1;
  ::testing::internal::CaptureStderr();
  {
    Checkpointer fast(&store, every_update, &h.server());
    ASSERT_TRUE(fast.WriteNow().ok());
  }
  Checkpointer checkpointer(&store, every_update, &h.server(),
                            /*write_delay=*/absl::Milliseconds(1500));
  h.server().Handle(Push(0, 2, 0, std::vector<float>(250000, 1.0f)));
  ExpectOk(h);
  checkpointer.MaybeWrite();  // starts a write that takes 1.5 s
  absl::SleepFor(absl::Milliseconds(1200));
  checkpointer.MaybeWrite();  // reports it
  checkpointer.MaybeWrite();  // not again within 5 s
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (checkpointer.busy() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    checkpointer.MaybeWrite();
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(checkpointer.busy());
  ASSERT_EQ(store.List().size(), 2u);
  const std::string writing =
      "writing checkpoint (1.0 MB, 1 key(s)): 1s so far";
  const size_t at = log.find(writing);
  ASSERT_NE(at, std::string::npos) << log;
  EXPECT_EQ(log.find(writing, at + 1), std::string::npos) << log;
  EXPECT_THAT(log, HasSubstr("checkpoint 2 written in 1."));
  EXPECT_THAT(log, HasSubstr("s (1.0 MB, 1 key(s))"));
  EXPECT_EQ(log.find("checkpoint 1 written"), std::string::npos)
      << "the fast write is not logged: " << log;
  std::filesystem::remove_all(dir);
}

// Elastic jobs (TESSERA_ELASTIC): a worker that left is out of the open round
// unless it pushed to it, and out of every later one; what it sends after is
// refused.
TEST(KVServerTest, ARoundCompletesWithoutAWorkerThatLeft) {
  ServerHarness h(/*num_workers=*/3);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  h.server().Handle(Push(0, 7, 0, {1, 10}));
  h.server().Handle(Push(1, 7, 0, {2, 20}));
  EXPECT_EQ(h.Pending(), 0u) << "two of three pushed: nobody is answered";
  h.server().WorkerLeft(2);
  ExpectOk(h);
  ExpectOk(h);
  // No optimizer: the value is the sum of the pushes the round got.
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{3, 30}));
  // The next round waits for the two left in the job only.
  h.server().Handle(Push(1, 7, 1, {4, 40}));
  EXPECT_EQ(h.Pending(), 0u);
  h.server().Handle(Push(0, 7, 1, {8, 80}));
  ExpectOk(h);
  ExpectOk(h);
  EXPECT_EQ(PullNow(h, 1, 7, 2), (std::vector<float>{12, 120}));
  EXPECT_EQ(h.server().stats().rounds_applied(), 2u);
  // The worker that left is refused, naming why.
  h.server().Handle(Push(2, 7, 0, {100, 100}));
  std::optional<Message> refused = h.NextReply();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(StatusOf(*refused).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(StatusOf(*refused).message()),
              HasSubstr("worker 2 is not in the job (TESSERA_ELASTIC: it "
                        "left, or has not joined)"));
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{12, 120}));
}

TEST(KVServerTest, APushMadeBeforeItsWorkerLeftCountsInItsRound) {
  ServerHarness h(/*num_workers=*/3);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  h.server().Handle(Push(2, 7, 0, {4, 40}));
  h.server().WorkerLeft(2);
  h.server().Handle(Push(0, 7, 0, {1, 10}));
  EXPECT_EQ(h.Pending(), 0u) << "worker 1 is still in the job";
  h.server().Handle(Push(1, 7, 0, {2, 20}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{7, 70}));
  // Its membership ends with that round.
  h.server().Handle(Push(0, 7, 1, {1, 1}));
  h.server().Handle(Push(1, 7, 1, {1, 1}));
  ExpectOk(h);
  ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{2, 2}));
}

// With an optimizer, a round of m pushes out of n workers updates with its
// sum times n / m: rescale_grad, set for n workers, still takes the mean.
TEST(KVServerTest, AnOptimizerGetsTheSumScaledToTheWorkersOfTheJob) {
  ServerHarness h(/*num_workers=*/4);
  h.server().Handle(SetOptimizer("sgd lr=1 rescale_grad=0.25"));
  ExpectOk(h);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  h.server().WorkerLeft(3);
  h.server().Handle(Push(0, 7, 0, {1, 2}));
  h.server().Handle(Push(1, 7, 0, {2, 4}));
  h.server().Handle(Push(2, 7, 0, {3, 6}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  // w = 0 - 1 x 0.25 x (sum x 4/3) = -(mean of the three pushes).
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{-2, -4}));
}

TEST(KVServerTest, RowRoundsCompleteWithoutAWorkerThatLeft) {
  ServerHarness h(/*num_workers=*/3);
  h.server().Handle(RowInit12());  // no value: zeros
  ExpectOk(h);
  h.server().Handle(RowMessage(wire::KV_PUSH, 0, 0, {1, 4}, {1, 2, 3, 4}));
  h.server().Handle(RowMessage(wire::KV_PUSH, 1, 0, {4}, {5, 6}));
  EXPECT_EQ(h.Pending(), 0u);
  h.server().WorkerLeft(2);
  ExpectOk(h);
  ExpectOk(h);
  h.server().Handle(RowMessage(wire::KV_PULL, 0, 0, {1, 4}, {}));
  std::optional<Message> r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  ASSERT_TRUE(StatusOf(*r).ok()) << StatusOf(*r);
  EXPECT_EQ(ValuesOf(*r), (std::vector<float>{1, 2, 8, 10}));
}

// A server made for at most 3 workers of a job of 2 (TESSERA_ELASTIC=_:3):
// rank 2 is out until it joins; a round does not wait for it before its
// first push to the slice, which enters the round under way; later rounds
// wait for it.
TEST(KVServerTest, AJoiningWorkerEntersTheRoundsWithItsFirstPush) {
  ServerHarness h(/*num_workers=*/3);
  h.server().set_elastic(/*nominal=*/2);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  h.server().Handle(Push(2, 7, 0, {100, 100}));
  std::optional<Message> refused = h.NextReply();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(StatusOf(*refused).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(StatusOf(*refused).message()),
              HasSubstr("worker 2 is not in the job"));
  h.server().WorkerJoined(2);
  // Not pushed yet: round 1 does not wait for it.
  h.server().Handle(Push(0, 7, 0, {1, 10}));
  h.server().Handle(Push(1, 7, 0, {2, 20}));
  ExpectOk(h);
  ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{3, 30}));
  // Round 2 is under way (rank 0 pushed) when rank 2 pushes: it enters it.
  h.server().Handle(Push(0, 7, 1, {1, 1}));
  h.server().Handle(Push(2, 7, 0, {4, 4}));
  EXPECT_EQ(h.Pending(), 0u) << "rank 1 is still to push";
  h.server().Handle(Push(1, 7, 1, {1, 1}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 1, 7, 2), (std::vector<float>{6, 6}))
      << "no optimizer: the value is round 2's sum of the three pushes";
  // Round 3 waits for all three.
  h.server().Handle(Push(0, 7, 2, {1, 1}));
  h.server().Handle(Push(1, 7, 2, {1, 1}));
  EXPECT_EQ(h.Pending(), 0u);
  h.server().Handle(Push(2, 7, 1, {1, 1}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 2, 7, 2), (std::vector<float>{3, 3}));
}

// A joiner's rejoin learns where the slice's rounds are; its entry names a
// round, and the slice waits for it from that round on, holding its pushes
// until then.
Message Rejoin(int rank, uint64_t key, uint64_t length) {
  Message m = KeyMessage(wire::KV_INIT, rank, key, length);
  m.header.set_rejoin(true);
  return m;
}

Message Entry(int rank, uint64_t key, uint64_t length, uint64_t at,
              uint64_t first_push) {
  Message m = Rejoin(rank, key, length);
  m.header.set_enter(true);
  m.header.set_enter_round(at);
  m.header.set_push_seq(first_push);
  return m;
}

TEST(KVServerTest, AJoinerEntersAtTheRoundItNamesAndItsPushWaitsForIt) {
  ServerHarness h(/*num_workers=*/3);
  h.server().set_elastic(/*nominal=*/2);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  h.server().WorkerJoined(2);
  // Round 0.
  h.server().Handle(Push(0, 7, 0, {1, 1}));
  h.server().Handle(Push(1, 7, 0, {1, 1}));
  ExpectOk(h);
  ExpectOk(h);
  h.server().Handle(Rejoin(2, 7, 2));
  std::optional<Message> where = h.NextReply();
  ASSERT_TRUE(where.has_value());
  EXPECT_TRUE(StatusOf(*where).ok());
  EXPECT_EQ(where->header.open_round(), 1u);
  EXPECT_TRUE(where->header.joining());
  h.server().Handle(Entry(2, 7, 2, /*at=*/2, /*first_push=*/0));
  std::optional<Message> entered = h.NextReply();
  ASSERT_TRUE(entered.has_value());
  EXPECT_TRUE(StatusOf(*entered).ok());
  EXPECT_EQ(entered->header.open_round(), 1u) << "taken: not past round 2";
  // Its first push comes early: it waits for round 2, and round 1 completes
  // without it.
  h.server().Handle(Push(2, 7, 0, {100, 100}));
  EXPECT_EQ(h.Pending(), 0u);
  h.server().Handle(Push(0, 7, 1, {2, 2}));
  h.server().Handle(Push(1, 7, 1, {2, 2}));
  ExpectOk(h);
  ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{4, 4}));
  // Round 2 has the held push and waits for the others.
  EXPECT_EQ(h.Pending(), 0u);
  h.server().Handle(Push(0, 7, 2, {3, 3}));
  EXPECT_EQ(h.Pending(), 0u) << "rank 1 is still to push";
  h.server().Handle(Push(1, 7, 2, {3, 3}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 1, 7, 2), (std::vector<float>{106, 106}));
  // And every later round waits for it.
  h.server().Handle(Push(0, 7, 3, {1, 1}));
  h.server().Handle(Push(1, 7, 3, {1, 1}));
  EXPECT_EQ(h.Pending(), 0u) << "rank 2 is in the rounds";
  h.server().Handle(Push(2, 7, 1, {1, 1}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
}

// A slice past the round named refuses the entry (its reply's open round is
// past it); an entry at the open round, moved later before the joiner
// pushed, lets that round complete without it.
TEST(KVServerTest, AnEntryPastTheOpenRoundIsRefusedAndALaterOneReplacesIt) {
  ServerHarness h(/*num_workers=*/3);
  h.server().set_elastic(/*nominal=*/2);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  h.server().WorkerJoined(2);
  for (uint64_t r = 0; r < 2; ++r) {
    h.server().Handle(Push(0, 7, r, {1, 1}));
    h.server().Handle(Push(1, 7, r, {1, 1}));
    ExpectOk(h);
    ExpectOk(h);
  }
  h.server().Handle(Entry(2, 7, 2, /*at=*/1, /*first_push=*/0));
  std::optional<Message> late = h.NextReply();
  ASSERT_TRUE(late.has_value());
  EXPECT_TRUE(StatusOf(*late).ok());
  EXPECT_EQ(late->header.open_round(), 2u) << "refused: past round 1";
  EXPECT_EQ(late->header.enter_round(), 1u);
  EXPECT_TRUE(late->header.joining());
  h.server().Handle(Entry(2, 7, 2, /*at=*/2, /*first_push=*/0));
  ExpectOk(h);
  h.server().Handle(Push(0, 7, 2, {1, 1}));
  h.server().Handle(Push(1, 7, 2, {1, 1}));
  EXPECT_EQ(h.Pending(), 0u) << "round 2 waits for the joiner";
  // The joiner moves its entry to round 3: round 2 completes without it.
  h.server().Handle(Entry(2, 7, 2, /*at=*/3, /*first_push=*/0));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{2, 2}));
}

// A joiner taking the rank of a worker that left numbers its pushes from the
// count it names (the largest over the key's slices): what the earlier
// holder sent is not taken for the joiner's.
TEST(KVServerTest, AJoinerNumbersItsPushesFromTheCountItNames) {
  ServerHarness h(/*num_workers=*/3);
  h.server().set_elastic(/*nominal=*/3);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  for (int rank = 0; rank < 3; ++rank)
    h.server().Handle(Push(rank, 7, 0, {1, 1}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  h.server().WorkerLeft(2);
  h.server().WorkerJoined(2);
  h.server().Handle(Rejoin(2, 7, 2));
  std::optional<Message> where = h.NextReply();
  ASSERT_TRUE(where.has_value());
  EXPECT_EQ(where->header.push_seq(), 1u) << "its rank's earlier holder's";
  h.server().Handle(Entry(2, 7, 2, /*at=*/1, /*first_push=*/4));
  ExpectOk(h);
  h.server().Handle(Push(0, 7, 1, {1, 1}));
  h.server().Handle(Push(1, 7, 1, {1, 1}));
  h.server().Handle(Push(2, 7, 1, {50, 50}));
  EXPECT_EQ(h.Pending(), 1u) << "push 1 is below 4: answered, not applied";
  ExpectOk(h);
  h.server().Handle(Push(2, 7, 4, {7, 7}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{9, 9}));
}

// dist_async: a joiner reusing the rank of a worker that pushed to this slice
// less often than to another (it left mid-push) is told it is joining, and
// its entry moves the slice's count up, so its first push is applied, and a
// push numbered below the entry is a duplicate.
TEST(KVServerTest, AnAsyncJoinerNumbersItsPushesFromTheCountItNames) {
  ServerHarness h(/*num_workers=*/2);
  h.server().set_elastic(/*nominal=*/2);
  h.server().Handle(SetOptimizer("sgd lr=1"));
  ExpectOk(h);
  h.server().Handle(Init(7, {0, 0}, /*sync=*/false));
  ExpectOk(h);
  h.server().Handle(Push(1, 7, 0, {1, 1}));  // rank 1's earlier holder
  ExpectOk(h);
  h.server().WorkerLeft(1);
  h.server().WorkerJoined(1);
  h.server().Handle(Rejoin(1, 7, 2));
  std::optional<Message> where = h.NextReply();
  ASSERT_TRUE(where.has_value());
  EXPECT_EQ(where->header.push_seq(), 1u);
  EXPECT_TRUE(where->header.joining());
  h.server().Handle(Entry(1, 7, 2, /*at=*/2, /*first_push=*/3));
  std::optional<Message> entered = h.NextReply();
  ASSERT_TRUE(entered.has_value());
  EXPECT_TRUE(StatusOf(*entered).ok()) << StatusOf(*entered);
  h.server().Handle(Push(1, 7, 1, {50, 50}));
  ExpectOk(h);  // below 3: answered as a duplicate, not applied
  h.server().Handle(Push(1, 7, 3, {2, 2}));
  ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{-3, -3}));
}

// A late copy of an earlier entry changes nothing (entries only move later);
// an open round holding a push of the rank's earlier holder cannot be
// entered, and the refusal says so (its open round past the one asked).
TEST(KVServerTest, EntriesOnlyMoveLaterAndARoundWithTheRanksPushIsRefused) {
  ServerHarness h(/*num_workers=*/3);
  h.server().set_elastic(/*nominal=*/3);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  h.server().Handle(Push(2, 7, 0, {5, 5}));  // rank 2's earlier holder
  EXPECT_EQ(h.Pending(), 0u);
  h.server().WorkerLeft(2);
  h.server().WorkerJoined(2);
  h.server().Handle(Entry(2, 7, 2, /*at=*/0, /*first_push=*/1));
  std::optional<Message> refused = h.NextReply();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->header.open_round(), 1u)
      << "refused: round 0 holds a push";
  h.server().Handle(Entry(2, 7, 2, /*at=*/3, /*first_push=*/1));
  ExpectOk(h);
  h.server().Handle(Entry(2, 7, 2, /*at=*/1, /*first_push=*/1));  // late copy
  ExpectOk(h);
  // Rounds 0, 1 and 2 complete without the joiner (round 0 with the earlier
  // holder's push), round 3 waits for it.
  h.server().Handle(Push(0, 7, 0, {1, 1}));
  h.server().Handle(Push(1, 7, 0, {1, 1}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  for (uint64_t r = 1; r < 3; ++r) {
    h.server().Handle(Push(0, 7, r, {1, 1}));
    h.server().Handle(Push(1, 7, r, {1, 1}));
    ExpectOk(h);
    ExpectOk(h);
  }
  h.server().Handle(Push(0, 7, 3, {1, 1}));
  h.server().Handle(Push(1, 7, 3, {1, 1}));
  EXPECT_EQ(h.Pending(), 0u) << "round 3 waits for the joiner";
  h.server().Handle(Push(2, 7, 1, {1, 1}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{3, 3}));
}

// With an optimizer, rounds are scaled to the job's own 2 workers: 2 pushes
// as they are, 3 (the joiner's in) by 2/3.
TEST(KVServerTest, RoundsWithAJoinerAreScaledToTheJobsWorkers) {
  ServerHarness h(/*num_workers=*/3);
  h.server().set_elastic(/*nominal=*/2);
  h.server().Handle(SetOptimizer("sgd lr=1 rescale_grad=0.5"));
  ExpectOk(h);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  h.server().WorkerJoined(2);
  h.server().Handle(Push(2, 7, 0, {6, 12}));
  h.server().Handle(Push(0, 7, 0, {3, 6}));
  EXPECT_EQ(h.Pending(), 0u) << "rank 1 is still to push";
  h.server().Handle(Push(1, 7, 0, {3, 6}));
  for (int i = 0; i < 3; ++i) ExpectOk(h);
  // w = 0 - 1 x 0.5 x (12 x 2/3) = -(mean of the three pushes).
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{-4, -8}));
}

// A worker of an elastic job that finished (KV_FINISH) is out of the rounds:
// the others go on training without it.
TEST(KVServerTest, AFinishedWorkerOfAnElasticJobIsOutOfTheRounds) {
  ServerHarness h(/*num_workers=*/2);
  h.server().set_elastic(/*nominal=*/2);
  h.server().Handle(Init(7, {0, 0}));
  ExpectOk(h);
  Message bye = KeyMessage(wire::KV_FINISH, 1, 0, 0);
  bye.header.clear_slice();
  h.server().Handle(std::move(bye));
  ExpectOk(h);
  h.server().Handle(Push(0, 7, 0, {1, 2}));
  ExpectOk(h);
  EXPECT_EQ(PullNow(h, 0, 7, 2), (std::vector<float>{1, 2}));
}

// Every worker finished or left: the server's part is done.
TEST(KVServerTest, WorkersFinishedCountsThoseThatLeft) {
  ServerHarness h(/*num_workers=*/3);
  int finished = 0;
  h.server().set_on_workers_finished([&finished] { ++finished; });
  Message bye = KeyMessage(wire::KV_FINISH, 0, 0, 0);
  bye.header.clear_slice();
  h.server().Handle(std::move(bye));
  h.server().WorkerLeft(1);
  EXPECT_EQ(finished, 0);
  bye = KeyMessage(wire::KV_FINISH, 2, 0, 0);
  bye.header.clear_slice();
  h.server().Handle(std::move(bye));
  EXPECT_EQ(finished, 1);
  h.server().WorkerLeft(1);  // told again: nothing changes
  EXPECT_EQ(finished, 1);
}

// What a server drops is counted, and a flood of it does not flood the log
// (issue #46): 1,000 unexpected replies and 1,000 messages from a node that
// is no worker are 2,000 malformed messages, logged 20 + 6 times (the 32nd,
// 64th, ..., 1024th); a worker's push after them is served. Malformed
// messages answered without a warning (30 requests without a key slice,
// first) are counted but do not use up the warnings.
// The value of counter `name` in this process's metrics (one KVServer
// alive), or -1 when it is not there.
double CounterValue(const std::string& name) {
  return testing::MetricValue(name, -1);
}

// Waits (at most 5 s) for counter `name` to reach `value`.
bool CounterReaches(const std::string& name, double value) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (CounterValue(name) < value && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(5));
  return CounterValue(name) == value;
}

// Issue #46: tessera_server_failed_replies_total counted only replies; an
// acknowledgement or a message to another server that the transport would
// not take went uncounted.
TEST(KVServerTest,
     AcknowledgementsAndServerSendsTheTransportRefusesAreCounted) {
  KVServer server(
      /*num_workers=*/2, /*num_threads=*/1, [](int, Message msg) {
        if (msg.header.ack_only() ||
            msg.header.command() == wire::KV_TRANSFER) {
          return absl::UnavailableError("its queue is full");
        }
        return absl::OkStatus();
      });
  EXPECT_EQ(CounterValue("tessera_server_failed_replies_total"), 0);
  EXPECT_EQ(CounterValue("tessera_server_failed_server_sends_total"), 0);
  server.Handle(Init(1, {1.0f, 2.0f}));
  server.Handle(Push(0, 1, 0, {0.5f, 0.5f}));  // the round waits for worker 1
  server.Handle(Push(0, 1, 0, {0.5f, 0.5f}));  // resent: acknowledged
  EXPECT_TRUE(CounterReaches("tessera_server_failed_replies_total", 1));
  // A replacement's asks for its slices go to the other servers.
  server.set_replication(/*rank=*/1, /*num_servers=*/3, /*replicas=*/2,
                         absl::Seconds(60));
  std::vector<ServerState> states(3);
  states[1].catching_up = true;
  states[1].joined = 1;
  server.UpdateServers(states);
  server.StartCatchUp([states] { return states; }, [] {});
  EXPECT_TRUE(CounterReaches("tessera_server_failed_server_sends_total", 2))
      << "an ask to server 0 and one to server 2";
}

TEST(KVServerTest, DroppedMessagesAreCountedAndTheirWarningsThrottled) {
  ServerHarness h(1);
  h.server().Handle(Init(1, {1.0f, 2.0f}));
  ExpectOk(h);
  for (int i = 0; i < 30; ++i) {
    Message unsliced = KeyMessage(wire::KV_PULL, 0, 1, 2);
    unsliced.header.clear_slice();
    h.server().Handle(std::move(unsliced));
  }
  for (int i = 0; i < 30; ++i) {
    std::optional<Message> r = h.NextReply();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(StatusOf(*r).code(), absl::StatusCode::kDataLoss) << StatusOf(*r);
  }
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 1000; ++i) {
    Message reply = KeyMessage(wire::KV_PUSH, 0, 1, 2);
    reply.header.set_is_response(true);
    h.server().Handle(std::move(reply));
    Message rogue = KeyMessage(wire::KV_PUSH, 0, 1, 2);
    rogue.header.set_sender(ServerId(3));
    h.server().Handle(std::move(rogue));
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(h.server().stats().malformed_messages(), 2030u);
  size_t lines = 0;
  for (size_t at = log.find("(malformed message #"); at != std::string::npos;
       at = log.find("(malformed message #", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 26u) << log;
  EXPECT_THAT(log, HasSubstr("dropped unexpected reply (malformed message "
                             "#31, warning #1;"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat(
                       "dropped message from non-worker node ", ServerId(3),
                       " (malformed message #32, warning #2;")));
  EXPECT_THAT(log, HasSubstr("(malformed message #1054, warning #1024;"));
  EXPECT_EQ(log.find("warning #1000;"), std::string::npos);
  EXPECT_EQ(h.Pending(), 0u) << "nothing dropped is answered";
  h.server().Handle(Push(0, 1, 0, {0.5f, 0.5f}));
  ExpectOk(h);
  EXPECT_EQ(h.server().stats().pushes_applied(), 1u);
  EXPECT_EQ(PullNow(h, 0, 1, 2), (std::vector<float>{0.5f, 0.5f}));
}

}  // namespace
}  // namespace tessera
