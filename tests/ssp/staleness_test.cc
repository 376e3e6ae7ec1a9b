// dist_ssp's hold logic on one server, no sockets (issue #49): the gate's
// arithmetic (StalenessGate), the server's clocks and held pulls
// (StalenessStats), and a KVServer holding pulls, and pushpull answers,
// until every worker in the job is at most s pushes behind the puller; a
// worker that left stops holding the others; bad inits are refused; a
// checkpoint keeps the bound.
#include "server/staleness.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/debug_pending.h"
#include "common/wire_status.h"
#include "gtest/gtest.h"
#include "server/kv_server.h"
#include "tests/support/kv_messages.h"
#include "tests/support/server_harness.h"

namespace tessera {
namespace {

// --- StalenessGate and StalenessStats alone -------------------------------

std::function<bool(int)> Everyone() {
  return [](int) { return true; };
}

PushLedger LedgerWith(const std::vector<uint64_t>& received) {
  PushLedger ledger(static_cast<int>(received.size()));
  for (size_t r = 0; r < received.size(); ++r)
    ledger.SetReceived(static_cast<int>(r), received[r]);
  return ledger;
}

TEST(StalenessGateTest, APullAtClockCWaitsForEveryRanksCMinusS) {
  const PushLedger ledger = LedgerWith({5, 3, 4});
  // s = 0: a pull after c pushes needs every rank's c.
  EXPECT_TRUE(StalenessGate(0).Open(3, ledger, Everyone()));
  EXPECT_FALSE(StalenessGate(0).Open(4, ledger, Everyone()));
  // s = 2: c - 2 of every rank; the slowest (rank 1) has 3.
  EXPECT_TRUE(StalenessGate(2).Open(5, ledger, Everyone()));
  EXPECT_FALSE(StalenessGate(2).Open(6, ledger, Everyone()));
  // Clocks below s never wait (no underflow of c - s).
  EXPECT_TRUE(StalenessGate(7).Open(0, LedgerWith({0, 0}), Everyone()));
  EXPECT_TRUE(StalenessGate(7).Open(7, LedgerWith({0, 0}), Everyone()));
  EXPECT_FALSE(StalenessGate(7).Open(8, LedgerWith({0, 0}), Everyone()));
  // A rank that does not count (out of the job) holds nobody back.
  EXPECT_TRUE(StalenessGate(0).Open(5, ledger, [](int r) { return r == 0; }));
}

TEST(StalenessGateTest, MeasureNamesTheSlowestCountingRankAndTheSpread) {
  const PushLedger ledger = LedgerWith({5, 3, 9});
  StalenessGate::Span all = StalenessGate::Measure(ledger, Everyone());
  EXPECT_EQ(all.slowest_rank, 1);
  EXPECT_EQ(all.slowest, 3u);
  EXPECT_EQ(all.spread, 6u);
  StalenessGate::Span two =
      StalenessGate::Measure(ledger, [](int r) { return r != 2; });
  EXPECT_EQ(two.slowest_rank, 1);
  EXPECT_EQ(two.spread, 2u);
  StalenessGate::Span none =
      StalenessGate::Measure(ledger, [](int) { return false; });
  EXPECT_EQ(none.slowest_rank, -1);
  EXPECT_EQ(none.spread, 0u);
}

TEST(StalenessGateTest, HeldPullsAreTimedOnceAndForgottenPerSender) {
  StalenessGate gate(1);
  const absl::Time t0 = absl::FromUnixSeconds(100);
  EXPECT_TRUE(gate.Hold(9, 1, t0));
  EXPECT_FALSE(gate.Hold(9, 1, t0 + absl::Seconds(1))) << "held already";
  EXPECT_TRUE(gate.Hold(9, 2, t0));
  EXPECT_TRUE(gate.Hold(11, 1, t0));
  EXPECT_EQ(gate.held(), 3u);
  EXPECT_EQ(gate.Release(9, 1, t0 + absl::Milliseconds(250)),
            absl::Milliseconds(250));
  EXPECT_EQ(gate.Release(9, 1, t0), std::nullopt) << "released already";
  EXPECT_EQ(gate.Forget(9), 1u);
  EXPECT_EQ(gate.Forget(9), 0u);
  EXPECT_EQ(gate.held(), 1u);
}

TEST(StalenessStatsTest, ClocksAndSpreadOfTheRanksInTheJob) {
  StalenessStats stats(3);
  EXPECT_EQ(stats.spread(), 0u) << "nobody pushed";
  stats.Pushed(0, 7);
  stats.Pushed(0, 4);  // another slice, behind: the clock keeps the most
  stats.Pushed(1, 2);
  EXPECT_EQ(stats.clock(0), 7u);
  EXPECT_EQ(stats.clock(1), 2u);
  EXPECT_EQ(stats.spread(), 5u) << "rank 2 never pushed: not counted";
  stats.SetInJob(1, false);
  EXPECT_EQ(stats.spread(), 0u) << "rank 1 left";
  stats.Pushed(2, 3);
  EXPECT_EQ(stats.spread(), 4u);
  stats.Held();
  stats.Held();
  EXPECT_EQ(stats.waiting(), 2);
  stats.Released(absl::Milliseconds(3));
  stats.Dropped(1);
  EXPECT_EQ(stats.waiting(), 0);
}

// --- A KVServer with dist_ssp keys ----------------------------------------

using testing::KeyMessage;
using testing::Pull;
using testing::Push;
using testing::ServerHarness;
using testing::ValuesOf;

Message SspInit(uint64_t key, const std::vector<float>& value,
                uint32_t staleness) {
  Message m = testing::Init(key, value, /*sync=*/false);
  m.header.mutable_kv_options()->set_bounded_staleness(true);
  m.header.mutable_kv_options()->set_staleness(staleness);
  return m;
}

// sgd lr=-1: each push is added to the weights, exactly.
void Start(ServerHarness& h) {
  h.server().Handle(testing::SetOptimizer("sgd lr=-1"));
  std::optional<Message> r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  ASSERT_TRUE(FromWire(r->header.status()).ok());
}

// The next reply: its command and values; fails the test on an error.
Message Answer(ServerHarness& h) {
  std::optional<Message> r = h.NextReply();
  EXPECT_TRUE(r.has_value()) << "no reply within 5 s";
  if (!r.has_value()) return Message();
  EXPECT_TRUE(FromWire(r->header.status()).ok())
      << FromWire(r->header.status());
  return *std::move(r);
}

void ExpectOk(ServerHarness& h) { Answer(h); }

// The values of the one of the next two replies that answers `cmd` (the
// other answers a push): the two may come in either order.
std::vector<float> OfTwoAnswers(ServerHarness& h, wire::Command cmd) {
  std::vector<float> values;
  for (int i = 0; i < 2; ++i) {
    Message r = Answer(h);
    if (r.header.command() == cmd) values = ValuesOf(r);
  }
  return values;
}

// A series' value in the process's metrics (0 when absent).
double MetricValue(const std::string& series) {
  return testing::MetricValue(series, 0);
}

// Three workers, s = 1; the key's value [a, b, c] counts each rank's pushes
// (rank r pushes a 1 at r), so a pull's value says which pushes it reflects.
TEST(KVServerStalenessTest, PullWaitsUntilNoWorkerIsMoreThanSBehind) {
  ServerHarness h(3);
  Start(h);
  h.server().Handle(SspInit(1, {0, 0, 0}, /*staleness=*/1));
  ExpectOk(h);
  const double held_before = MetricValue("tessera_server_ssp_pulls_held_total");
  // Rank 0 runs ahead: two pushes, then a pull at clock 2, which needs
  // every rank's first push (2 - s = 1).
  h.server().Handle(Push(0, 1, 0, {1, 0, 0}));
  h.server().Handle(Push(0, 1, 1, {1, 0, 0}));
  ExpectOk(h);
  ExpectOk(h);
  h.server().Handle(Pull(0, 1, 3, 2));
  EXPECT_EQ(h.Pending(), 0u) << "ranks 1 and 2 have no push yet: held";
  EXPECT_EQ(MetricValue("tessera_server_ssp_pulls_held_total"),
            held_before + 1);
  EXPECT_EQ(MetricValue("tessera_server_ssp_pulls_waiting"), 1);
  // A pull at clock 1 (1 - s = 0) never waits: rank 1's, say.
  h.server().Handle(Pull(1, 1, 3, 0));
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{2, 0, 0}));
  h.server().Handle(Push(1, 1, 0, {0, 1, 0}));
  ExpectOk(h);
  EXPECT_EQ(h.Pending(), 0u) << "rank 2 still has none: held";
  h.server().Handle(Push(2, 1, 0, {0, 0, 1}));
  // Rank 2's push reply and rank 0's pull, in either order.
  const std::vector<float> pulled = OfTwoAnswers(h, wire::KV_PULL);
  EXPECT_EQ(pulled, (std::vector<float>{2, 1, 1}));
  EXPECT_EQ(MetricValue("tessera_server_ssp_pulls_waiting"), 0);
  EXPECT_EQ(MetricValue("tessera_server_ssp_clock{rank=\"0\"}"), 2);
  EXPECT_EQ(MetricValue("tessera_server_ssp_clock_spread"), 1);
  EXPECT_EQ(h.server().stats().rounds_applied(), 0u)
      << "no rounds: each push applied on its own";
  EXPECT_EQ(h.server().stats().pushes_applied(), 4u);
}

// s = 0 waits for every worker's step, but is no dist_sync round: each push
// is applied on its own (with the optimizer), and a pull may already see a
// faster worker's next push.
TEST(KVServerStalenessTest, ZeroStalenessIsAStepOfSingleUpdates) {
  ServerHarness h(2);
  Start(h);
  h.server().Handle(SspInit(2, {0, 0}, 0));
  ExpectOk(h);
  h.server().Handle(Push(0, 2, 0, {1, 0}));
  ExpectOk(h);
  h.server().Handle(Pull(0, 2, 2, 1));
  EXPECT_EQ(h.Pending(), 0u) << "rank 1 has not pushed step 0";
  h.server().Handle(Push(1, 2, 0, {0, 1}));
  const std::vector<float> pulled = OfTwoAnswers(h, wire::KV_PULL);
  EXPECT_EQ(pulled, (std::vector<float>{1, 1}));
  // Rank 1 is faster: its step 1 is applied before rank 0's pull at clock 1,
  // which then sees it (a dist_sync pull would see round 0's sum only).
  h.server().Handle(Push(1, 2, 1, {0, 1}));
  ExpectOk(h);
  h.server().Handle(Pull(0, 2, 2, 1));
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{1, 2}));
  EXPECT_EQ(h.server().stats().rounds_applied(), 0u);
}

// A worker that left the job (or was declared dead) holds nobody back: the
// pulls waiting for it are answered, later ones do not wait for it.
TEST(KVServerStalenessTest, AWorkerThatLeftStopsHoldingTheOthers) {
  ServerHarness h(3);
  Start(h);
  h.server().Handle(SspInit(3, {0, 0, 0}, 1));
  ExpectOk(h);
  for (uint64_t seq = 0; seq < 3; ++seq) {
    h.server().Handle(Push(0, 3, seq, {1, 0, 0}));
    h.server().Handle(Push(1, 3, seq, {0, 1, 0}));
    ExpectOk(h);
    ExpectOk(h);
  }
  h.server().Handle(Push(2, 3, 0, {0, 0, 1}));
  ExpectOk(h);
  h.server().Handle(Pull(0, 3, 3, 3));
  EXPECT_EQ(h.Pending(), 0u) << "rank 2 has 1 push of the 2 needed";
  h.server().WorkerLeft(2);
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{3, 3, 1}));
  for (uint64_t seq = 3; seq < 5; ++seq) {
    h.server().Handle(Push(0, 3, seq, {1, 0, 0}));
    ExpectOk(h);
  }
  h.server().Handle(Pull(0, 3, 3, 5));
  EXPECT_EQ(h.Pending(), 0u) << "5 - s = 4 of rank 1 needed, it has 3";
  h.server().Handle(Pull(1, 3, 3, 3));
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{5, 3, 1}))
      << "rank 1 at 3 needs 2 of every rank in the job, not of rank 2";
  h.server().Handle(Push(1, 3, 3, {0, 1, 0}));
  const std::vector<float> pulled = OfTwoAnswers(h, wire::KV_PULL);
  EXPECT_EQ(pulled, (std::vector<float>{5, 4, 1}));
}

// A pushpull's push is applied at once; its answer (the weights) waits for
// the bound as a pull made after it would. Its resent copy is acknowledged.
TEST(KVServerStalenessTest, PushPullAnswerWaitsForTheBound) {
  ServerHarness h(2);
  Start(h);
  h.server().Handle(SspInit(4, {0, 0}, 0));
  ExpectOk(h);
  Message pushpull = Push(0, 4, 0, {1, 0}, wire::KV_PUSHPULL);
  Message resent = pushpull;
  h.server().Handle(std::move(pushpull));
  EXPECT_EQ(h.Pending(), 0u) << "rank 1 has not pushed step 0";
  h.server().Handle(std::move(resent));
  std::optional<Message> ack = h.NextReply(/*skip_acks=*/false);
  ASSERT_TRUE(ack.has_value());
  EXPECT_TRUE(ack->header.ack_only());
  // Rank 1's pull at clock 0 sees rank 0's push: it was applied on arrival.
  h.server().Handle(Pull(1, 4, 2, 0));
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{1, 0}));
  h.server().Handle(Push(1, 4, 0, {0, 1}));
  const std::vector<float> answered = OfTwoAnswers(h, wire::KV_PUSHPULL);
  EXPECT_EQ(answered, (std::vector<float>{1, 1}));
  EXPECT_EQ(h.server().stats().duplicates(), 1u) << "the resent copy only";
  EXPECT_EQ(h.server().stats().pushes_applied(), 2u);
}

TEST(KVServerStalenessTest, InitsWithABadBoundAreRefused) {
  ServerHarness h(1);
  h.server().Handle(SspInit(5, {0}, 1000001));
  std::optional<Message> r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  absl::Status s = FromWire(r->header.status());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "init of dist_ssp key 5: staleness 1000001: expected a whole "
            "number of steps in 0..1000000");
  Message both = SspInit(6, {0}, 1);
  both.header.mutable_kv_options()->set_sync_mode(true);
  h.server().Handle(std::move(both));
  r = h.NextReply();
  ASSERT_TRUE(r.has_value());
  s = FromWire(r->header.status());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "init of key 6: a key is dist_sync or dist_ssp, not both");
}

// The hang doctor (/debug/pending) names, for each pull the bound holds, the
// slowest rank in the job, which holds it, and by how many steps: the
// puller's clock minus s minus that rank's pushes.
TEST(KVServerStalenessTest, DebugPendingNamesWhoHoldsAPullAndByHowMuch) {
  ServerHarness h(3);
  Start(h);
  h.server().Handle(SspInit(8, {0, 0, 0}, /*staleness=*/1));
  ExpectOk(h);
  // Rank 0 at 4 pushes, rank 1 at 3, rank 2 at 1.
  const std::vector<uint64_t> pushes = {4, 3, 1};
  for (int r = 0; r < 3; ++r) {
    std::vector<float> grad(3, 0.0f);
    grad[r] = 1;
    for (uint64_t seq = 0; seq < pushes[r]; ++seq) {
      h.server().Handle(Push(r, 8, seq, grad));
      ExpectOk(h);
    }
  }
  // Rank 0's pull at clock 4 needs 3 pushes of every rank: rank 2 is 2
  // short. Rank 1's at clock 3 needs 2: rank 2 is 1 short.
  h.server().Handle(Pull(0, 8, 3, 4));
  h.server().Handle(Pull(1, 8, 3, 3));
  EXPECT_EQ(h.Pending(), 0u);
  wire::DebugPending pending = DebugPendingRegistry::Global().Collect();
  ASSERT_EQ(pending.held_pulls_size(), 2) << PendingJson(pending);
  EXPECT_EQ(pending.held_pulls_total(), 2);
  const wire::HeldPull& first = pending.held_pulls(0);
  EXPECT_EQ(first.key(), 8u);
  EXPECT_EQ(first.offset(), 0u);
  EXPECT_EQ(first.rank(), 0);
  EXPECT_EQ(first.command(), "KV_PULL");
  EXPECT_EQ(first.clock(), 4u);
  EXPECT_EQ(first.staleness(), 1u);
  EXPECT_EQ(first.held_by(), 2);
  EXPECT_EQ(first.held_by_pushes(), 1u);
  EXPECT_EQ(first.steps(), 2u);
  EXPECT_GE(first.age_s(), 0.0);
  const wire::HeldPull& second = pending.held_pulls(1);
  EXPECT_EQ(second.rank(), 1);
  EXPECT_EQ(second.clock(), 3u);
  EXPECT_EQ(second.held_by(), 2);
  EXPECT_EQ(second.steps(), 1u);
  // As the JSON shows it (64-bit integers are strings in proto3's JSON).
  pending.mutable_held_pulls(0)->set_age_s(0.5);
  const std::string json = PendingJson(pending);
  EXPECT_NE(json.find("{\"key\":\"8\",\"offset\":\"0\",\"rank\":0,"
                      "\"command\":\"KV_PULL\",\"clock\":\"4\","
                      "\"staleness\":1,\"held_by\":2,\"held_by_pushes\":"
                      "\"1\",\"steps\":\"2\",\"age_s\":0.5}"),
            std::string::npos)
      << json;
  // Rank 2's next push: rank 1's pull goes; rank 0's waits for 1 more step,
  // still for rank 2.
  h.server().Handle(Push(2, 8, 1, {0, 0, 1}));
  ExpectOk(h);
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{4, 3, 2}));
  pending = DebugPendingRegistry::Global().Collect();
  ASSERT_EQ(pending.held_pulls_size(), 1) << PendingJson(pending);
  EXPECT_EQ(pending.held_pulls(0).rank(), 0);
  EXPECT_EQ(pending.held_pulls(0).held_by(), 2);
  EXPECT_EQ(pending.held_pulls(0).held_by_pushes(), 2u);
  EXPECT_EQ(pending.held_pulls(0).steps(), 1u);
  h.server().Handle(Push(2, 8, 2, {0, 0, 1}));
  ExpectOk(h);
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{4, 3, 3}));
  pending = DebugPendingRegistry::Global().Collect();
  EXPECT_EQ(pending.held_pulls_size(), 0) << PendingJson(pending);
  EXPECT_EQ(pending.held_pulls_total(), 0);
}

// A worker's rejoin (KV_INIT with rejoin, from its life `generation`), and a
// joiner's entry at `clock` (with enter).
Message Rejoin(int rank, uint64_t key, uint64_t n, uint64_t generation) {
  Message m = KeyMessage(wire::KV_INIT, rank, key, n);
  m.header.set_rejoin(true);
  m.header.set_generation(generation);
  return m;
}
Message Entry(int rank, uint64_t key, uint64_t n, uint64_t clock) {
  Message m = Rejoin(rank, key, n, 1);
  m.header.set_enter(true);
  m.header.set_enter_round(0);
  m.header.set_push_seq(clock);
  return m;
}

// The replies to a push and a held pull it releases, in either order: the
// pull's values.
std::vector<float> ReleasedPull(ServerHarness& h) {
  std::vector<float> pulled;
  for (int i = 0; i < 2; ++i) {
    Message r = Answer(h);
    if (r.header.command() == wire::KV_PULL) pulled = ValuesOf(r);
  }
  return pulled;
}

// Elastic job (2 of at most 3 workers): rank 2 joins with ranks 0 and 1 at 5
// and 3 pushes. It starts at the slowest clock, 3: the rejoin's reply says
// so, it holds nobody back before its entry, and after it the bound waits
// for it from 3 on (its first push is number 3, its pulls wait as at 3).
TEST(KVServerStalenessTest, AJoiningWorkerStartsAtTheSlowestClock) {
  ServerHarness h(3);
  h.server().set_elastic(2);
  Start(h);
  h.server().Handle(SspInit(9, {0, 0, 0}, /*staleness=*/1));
  ExpectOk(h);
  for (uint64_t seq = 0; seq < 5; ++seq) {
    h.server().Handle(Push(0, 9, seq, {1, 0, 0}));
    ExpectOk(h);
  }
  for (uint64_t seq = 0; seq < 3; ++seq) {
    h.server().Handle(Push(1, 9, seq, {0, 1, 0}));
    ExpectOk(h);
  }
  h.server().WorkerJoined(2);
  h.server().Handle(Rejoin(2, 9, 3, /*generation=*/1));
  Message rejoined = Answer(h);
  EXPECT_EQ(rejoined.header.push_seq(), 3u) << "rank 1's clock, the slowest";
  EXPECT_TRUE(rejoined.header.joining());
  // Not entered yet: rank 0's pull at clock 4 needs 3 of ranks 0 and 1 only.
  h.server().Handle(Pull(0, 9, 3, 4));
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{5, 3, 0}));
  h.server().Handle(Entry(2, 9, 3, /*clock=*/3));
  Message entered = Answer(h);
  EXPECT_FALSE(entered.header.joining());
  h.server().Handle(Push(1, 9, 3, {0, 1, 0}));
  ExpectOk(h);
  // Rank 0 at 5 needs 4 of every rank: rank 2, at 3, is 1 step short.
  h.server().Handle(Pull(0, 9, 3, 5));
  EXPECT_EQ(h.Pending(), 0u);
  const wire::DebugPending pending = DebugPendingRegistry::Global().Collect();
  ASSERT_EQ(pending.held_pulls_size(), 1) << PendingJson(pending);
  EXPECT_EQ(pending.held_pulls(0).held_by(), 2);
  EXPECT_EQ(pending.held_pulls(0).held_by_pushes(), 3u);
  EXPECT_EQ(pending.held_pulls(0).steps(), 1u);
  // The joiner's pull at its clock, 3, needs 2 of every rank: answered.
  h.server().Handle(Pull(2, 9, 3, 3));
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{5, 4, 0}));
  // Its first push is number 3, taken (not a duplicate): rank 0's pull goes.
  h.server().Handle(Push(2, 9, 3, {0, 0, 1}));
  EXPECT_EQ(ReleasedPull(h), (std::vector<float>{5, 4, 1}));
  EXPECT_EQ(h.server().stats().duplicates(), 0u);
  // Its pull at 4, after that push, needs 3 of every rank: answered.
  h.server().Handle(Pull(2, 9, 3, 4));
  EXPECT_EQ(ValuesOf(Answer(h)), (std::vector<float>{5, 4, 1}));
  EXPECT_EQ(MetricValue("tessera_server_ssp_clock{rank=\"2\"}"), 4);
}

// A worker restarted into the job (--restarts) keeps its rank and its place:
// while it is down it still holds the others (it never left), its rejoin
// resumes at its count (not joining, no new clock), and its new life's next
// push releases them.
TEST(KVServerStalenessTest, ARestartedWorkerResumesAtItsOwnClock) {
  ServerHarness h(2);
  Start(h);
  h.server().Handle(SspInit(10, {0, 0}, /*staleness=*/1));
  ExpectOk(h);
  for (uint64_t seq = 0; seq < 3; ++seq) {
    h.server().Handle(Push(0, 10, seq, {1, 0}));
    ExpectOk(h);
  }
  h.server().Handle(Push(1, 10, 0, {0, 1}));
  ExpectOk(h);
  // Rank 1 dies with 1 push taken; rank 0's pull at 3 needs 2 of it.
  h.server().Handle(Pull(0, 10, 2, 3));
  EXPECT_EQ(h.Pending(), 0u);
  h.server().Handle(Rejoin(1, 10, 2, /*generation=*/1));
  Message rejoined = Answer(h);
  EXPECT_EQ(rejoined.header.push_seq(), 1u) << "its own count";
  EXPECT_FALSE(rejoined.header.joining());
  EXPECT_EQ(h.Pending(), 0u) << "still held: rank 1 is in the job at 1";
  Message again = Push(1, 10, 1, {0, 1});
  again.header.set_generation(1);
  h.server().Handle(std::move(again));
  EXPECT_EQ(ReleasedPull(h), (std::vector<float>{3, 2}));
}

// A checkpoint keeps a slice's bound: restored, its pulls wait as before.
TEST(KVServerStalenessTest, ACheckpointKeepsTheBound) {
  wire::ServerCheckpoint saved;
  {
    ServerHarness h(2);
    Start(h);
    h.server().Handle(SspInit(7, {0, 0}, 2));
    ExpectOk(h);
    h.server().Handle(Push(0, 7, 0, {1, 0}));
    ExpectOk(h);
    absl::Notification done;
    h.server().Snapshot([&](wire::ServerCheckpoint shard) {
      saved = std::move(shard);
      done.Notify();
    });
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  }
  ASSERT_EQ(saved.keys_size(), 1);
  EXPECT_TRUE(saved.keys(0).bounded_staleness());
  EXPECT_EQ(saved.keys(0).staleness(), 2u);
  ServerHarness h(2);
  ASSERT_TRUE(h.server().Restore(saved).ok());
  for (uint64_t seq = 1; seq < 3; ++seq) {
    h.server().Handle(Push(0, 7, seq, {1, 0}));
    ExpectOk(h);
  }
  h.server().Handle(Pull(0, 7, 2, 3));
  EXPECT_EQ(h.Pending(), 0u) << "3 - s = 1 push of rank 1 needed";
  h.server().Handle(Push(1, 7, 0, {0, 1}));
  const std::vector<float> pulled = OfTwoAnswers(h, wire::KV_PULL);
  EXPECT_EQ(pulled, (std::vector<float>{3, 1}));
}

}  // namespace
}  // namespace tessera
