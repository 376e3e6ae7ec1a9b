#include "worker/client/request_tracker.h"

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/message.h"
#include "common/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// Records what the tracker sends: (server, request id) in order.
class Sent {
 public:
  RequestTracker::SendFn Fn() {
    return [this](int server, Message msg) {
      absl::MutexLock lock(&mu_);
      sent_.emplace_back(server, msg.header.request_id());
      return absl::OkStatus();
    };
  }
  std::vector<std::pair<int, uint64_t>> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(sent_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<int, uint64_t>> sent_ ABSL_GUARDED_BY(mu_);
};

Message Reply(int server, uint64_t request_id, bool ack_only = false) {
  Message m;
  m.header.set_is_response(true);
  m.header.set_sender(server);
  m.header.set_request_id(request_id);
  m.header.set_ack_only(ack_only);
  return m;
}

RequestTracker::Request Req(uint64_t op, int server, int window) {
  RequestTracker::Request r;
  r.op = op;
  r.server = server;
  r.window = window;
  return r;
}

using ::testing::ElementsAre;
using ::testing::Pair;

// A push's slices to one server go `window` at a time; the next one leaves
// when an earlier one is answered (an acknowledgement does not free a place),
// each server's window counts apart, and a request without a window is never
// held (a pull issued right after the push goes out at once: row pushes keep
// their window small so that it is not queued behind the whole push).
TEST(RequestTrackerTest, WindowedRequestsGoAsEarlierOnesAreAnswered) {
  RequestTracker::Options options;
  options.resend = false;
  Sent sent;
  RequestTracker tracker(options, sent.Fn(),
                         [](int node) { return std::to_string(node); });
  const uint64_t push = tracker.NewOp();
  for (int i = 0; i < 4; ++i) tracker.Send(Req(push, 8, 2), Message());
  tracker.Send(Req(push, 10, 2), Message());
  const uint64_t pull = tracker.NewOp();
  tracker.Send(Req(pull, 8, 0), Message());
  // Request ids are numbered in Send order from 1: 1-4 to server 8, 5 to
  // server 10, 6 (the pull) to server 8.
  EXPECT_THAT(sent.Take(),
              ElementsAre(Pair(8, 1), Pair(8, 2), Pair(10, 5), Pair(8, 6)));

  tracker.HandleReply(Reply(8, 1, /*ack_only=*/true));
  EXPECT_THAT(sent.Take(), ElementsAre()) << "an acknowledgement frees nothing";
  tracker.HandleReply(Reply(8, 2));
  EXPECT_THAT(sent.Take(), ElementsAre(Pair(8, 3)));
  tracker.HandleReply(Reply(8, 1));
  EXPECT_THAT(sent.Take(), ElementsAre(Pair(8, 4)));
  tracker.HandleReply(Reply(8, 6));
  EXPECT_TRUE(tracker.Wait(pull, "pull").ok());
  for (uint64_t id : {3, 4}) tracker.HandleReply(Reply(8, id));
  tracker.HandleReply(Reply(10, 5));
  EXPECT_THAT(sent.Take(), ElementsAre());
  EXPECT_TRUE(tracker.Wait(push, "push").ok());
}

// Without resends (PS_RESEND=0) a request whose send fails is gone, also one
// its window let out after an answer; the slices the window still held back
// fail with it instead of waiting for an answer that cannot come (Wait
// returned only at its deadline, 600 s by default).
TEST(RequestTrackerTest, AFailedSendWithoutResendsFailsWhatItsWindowHolds) {
  RequestTracker::Options options;
  options.resend = false;
  options.request_timeout = absl::Seconds(30);
  int sends = 0;
  RequestTracker tracker(
      options,
      [&sends](int, Message) {
        return ++sends == 3 ? absl::UnavailableError("peer gone")
                            : absl::OkStatus();
      },
      [](int node) { return std::to_string(node); });
  const uint64_t push = tracker.NewOp();
  for (int i = 0; i < 4; ++i) tracker.Send(Req(push, 8, 2), Message());
  EXPECT_EQ(sends, 2) << "the third and fourth are held by the window";
  // An answer lets the third out, and its send fails.
  tracker.HandleReply(Reply(8, 2));
  EXPECT_EQ(sends, 3);
  tracker.HandleReply(Reply(8, 1));
  EXPECT_EQ(sends, 3) << "the fourth failed with the third's window";
  const absl::Time start = absl::Now();
  const absl::Status done = tracker.Wait(push, "push");
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(done.code(), absl::StatusCode::kUnavailable) << done;
  EXPECT_THAT(std::string(done.message()), ::testing::HasSubstr("peer gone"));
}

// A reply comes from a node the request was sent to: its server, or where a
// slice has a chain (TESSERA_REPLICAS > 1) the server the route aimed it at
// after a fail-over or a hand-back. A reply or an acknowledgement from any
// other node (a compromised server answering for another, issue #46; a
// backup answering its live primary's requests included) is dropped, counted
// and logged naming the sender: it neither answers the request nor keeps it
// alive, and the right server's answer still completes it.
TEST(RequestTrackerTest, OnlyANodeTheRequestWentToAnswersIt) {
  MetricsRegistry& metrics = MetricsRegistry::Global();
  Counter* wrong =
      metrics.GetCounter("tessera_worker_wrong_server_replies_total", "");
  const uint64_t wrong_before = wrong->value();
  auto describe = [](int node) { return absl::StrCat("node ", node); };
  {
    RequestTracker::Options options;
    options.resend = false;
    Sent sent;
    RequestTracker tracker(options, sent.Fn(), describe);
    const uint64_t pull = tracker.NewOp();
    tracker.Send(Req(pull, ServerId(0), 0), Message());
    tracker.HandleReply(Reply(ServerId(1), 1));
    tracker.HandleReply(Reply(WorkerId(0), 1));
    tracker.HandleReply(Reply(kSchedulerId, 1, /*ack_only=*/true));
    EXPECT_EQ(wrong->value() - wrong_before, 3u);
    tracker.HandleReply(Reply(ServerId(0), 1));
    EXPECT_TRUE(tracker.Wait(pull, "pull").ok());
  }
  // 4 servers, chains of 2: a slice first on rank 3 has the chain 3, 0; an
  // init for place 1 sent to rank 1 is for the chain 0, 1. The route sends
  // rank 3's requests to `primary`.
  RequestTracker::Options options;
  options.resend_timeout = absl::Milliseconds(200);
  options.request_timeout = absl::Seconds(30);
  Sent sent;
  std::atomic<int> primary{ServerId(3)};
  RequestTracker tracker(options, sent.Fn(), describe, nullptr, nullptr,
                         [&primary](int server, Message*) {
                           return server == ServerId(3) ? primary.load()
                                                        : server;
                         });
  const uint64_t push = tracker.NewOp();
  tracker.Send(Req(push, ServerId(3), 0), Message());  // request 1
  Message init;
  init.header.set_command(wire::KV_INIT);
  init.header.set_replica(1);
  tracker.Send(Req(push, ServerId(1), 0), std::move(init));  // request 2
  const uint64_t before = wrong->value();
  ::testing::internal::CaptureStderr();
  // The backup of rank 3's slice answers while rank 3 is alive; the init's
  // chain's first answers the init sent to rank 1; others acknowledge.
  tracker.HandleReply(Reply(ServerId(0), 1));
  tracker.HandleReply(Reply(ServerId(2), 1));
  tracker.HandleReply(Reply(ServerId(0), 2));
  tracker.HandleReply(Reply(ServerId(3), 2, /*ack_only=*/true));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(wrong->value() - before, 4u);
  EXPECT_THAT(log, ::testing::HasSubstr(absl::StrCat(
                       "to request 1 from node ", ServerId(0),
                       ": it was sent to node ", ServerId(3), " only")));
  // Rank 3 fails over to rank 0: request 1 goes there now, and rank 0's
  // answer is taken.
  primary.store(ServerId(0));
  tracker.ResendNowTo(ServerId(3), absl::InfiniteFuture());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool resent = false;
  while (!resent && absl::Now() < deadline) {
    for (const auto& [to, id] : sent.Take())
      resent = resent || (to == ServerId(0) && id == 1);
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(resent);
  tracker.HandleReply(Reply(ServerId(0), 1));
  tracker.HandleReply(Reply(ServerId(1), 2));
  EXPECT_TRUE(tracker.Wait(push, "push").ok());
  EXPECT_EQ(wrong->value() - before, 4u);
}

// A request fails after TESSERA_RESEND_RETRIES sends in a row that nothing
// from its server followed. A server that keeps sending (late answers to
// finished requests, as a server working through resent copies does) is
// busy, not gone: its request waits on, and fails once that server too has
// been silent for as many sends, or after 4x as many sends that it neither
// answered nor acknowledged. (Found under TSan: a server slowed by resent
// 1 MB copies answered every one, 1-3 s late, and a worker gave up on it
// after 8 sends over 2.4 s, failing a job that was moving.)
TEST(RequestTrackerTest, OnlyASilentServerFailsARequestAtTheResendLimit) {
  RequestTracker::Options options;
  options.resend_timeout = absl::Milliseconds(20);  // 20, 40, 80, 160, 160...
  options.resend_retries = 3;
  options.request_timeout = absl::Seconds(60);
  Sent sent;
  RequestTracker tracker(options, sent.Fn(),
                         [](int node) { return absl::StrCat("node ", node); });
  // Server 0 answers a request finished long ago, every 2 ms, while `talking`.
  std::atomic<bool> talking{true};
  std::atomic<int> said{0};
  std::thread talker([&] {
    while (talking.load()) {
      tracker.HandleReply(Reply(ServerId(0), 999));
      ++said;
      absl::SleepFor(absl::Milliseconds(2));
    }
  });
  while (said.load() == 0) absl::SleepFor(absl::Milliseconds(1));
  const absl::Time start = absl::Now();
  const uint64_t busy = tracker.NewOp();
  tracker.Send(Req(busy, ServerId(0), 0), Message());  // request 1
  const uint64_t silent = tracker.NewOp();
  tracker.Send(Req(silent, ServerId(1), 0), Message());  // request 2
  const absl::Status silent_done = tracker.Wait(silent, "push");
  EXPECT_EQ(silent_done.code(), absl::StatusCode::kUnavailable) << silent_done;
  EXPECT_THAT(std::string(silent_done.message()),
              ::testing::HasSubstr(absl::StrCat(
                  "no answer from node ", ServerId(1), " after 3 sends over")));
  // The busy server's request, never answered nor acknowledged, fails after
  // 4 x 3 = 12 sends (about 1.4 s of waits) although its server talks on.
  const absl::Status busy_done = tracker.Wait(busy, "push");
  const absl::Duration busy_after = absl::Now() - start;
  talking.store(false);
  talker.join();
  EXPECT_EQ(busy_done.code(), absl::StatusCode::kUnavailable) << busy_done;
  EXPECT_THAT(std::string(busy_done.message()),
              ::testing::HasSubstr(absl::StrCat(
                  "no answer from node ", ServerId(0),
                  " after 12 sends, neither answered nor acknowledged while "
                  "it answered other requests, over")));
  EXPECT_LT(busy_after, absl::Seconds(30));
  EXPECT_GE(busy_after, absl::Milliseconds(20 + 40 + 80 + 160 * 8))
      << "given up while its server was still sending";

  // Acknowledged, a request waits on as long as the acknowledgements come
  // (a push held for a slow round); silent, it then fails after 3 sends.
  const uint64_t held = tracker.NewOp();
  tracker.Send(Req(held, ServerId(2), 0), Message());  // request 3
  const absl::Time held_from = absl::Now();
  std::atomic<bool> acking{true};
  std::thread acker([&] {
    while (acking.load()) {
      tracker.HandleReply(Reply(ServerId(2), 3, /*ack_only=*/true));
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  absl::SleepFor(absl::Seconds(3));  // well past 12 sends' waits
  acking.store(false);
  acker.join();
  const absl::Status held_done = tracker.Wait(held, "push");
  EXPECT_GE(absl::Now() - held_from, absl::Seconds(3));
  EXPECT_EQ(held_done.code(), absl::StatusCode::kUnavailable) << held_done;
  EXPECT_THAT(std::string(held_done.message()),
              ::testing::HasSubstr(absl::StrCat(
                  "no answer from node ", ServerId(2), " after 3 sends over")));
}

// A request nobody waits for (a replay to a restarted server: op 0, no
// Wait's deadline) that its server acknowledges now and then, never
// answering it, ends all the same at TESSERA_TIMEOUT. Before (the adversarial
// review of issue #46), each acknowledgement reset its count of sends, and it
// was resent for ever.
TEST(RequestTrackerTest, AReplayAcknowledgedButNeverAnsweredEndsAtTheTimeout) {
  RequestTracker::Options options;
  options.resend_timeout = absl::Milliseconds(20);  // waits up to 160 ms
  options.resend_retries = 3;
  options.request_timeout = absl::Seconds(1);
  Sent sent;
  RequestTracker tracker(options, sent.Fn(),
                         [](int node) { return absl::StrCat("node ", node); });
  tracker.Send(Req(0, ServerId(3), 0), Message());  // request 1, a replay
  // Acknowledged every 300 ms: about one resend between two of them, so the
  // count of unanswered sends never reaches the limit.
  std::atomic<bool> acking{true};
  std::thread acker([&] {
    while (acking.load()) {
      tracker.HandleReply(Reply(ServerId(3), 1, /*ack_only=*/true));
      absl::SleepFor(absl::Milliseconds(300));
    }
  });
  absl::SleepFor(absl::Milliseconds(700));
  EXPECT_FALSE(sent.Take().empty()) << "resent while it is tracked";
  absl::SleepFor(absl::Seconds(1.3));  // past the time-out
  sent.Take();
  absl::SleepFor(absl::Seconds(1));
  const std::vector<std::pair<int, uint64_t>> late = sent.Take();
  acking.store(false);
  acker.join();
  EXPECT_TRUE(late.empty()) << late.size() << " resends after the time-out";
}

// Keeps what the tracker sends, whole, for a test to take in order.
class Recorder {
 public:
  RequestTracker::SendFn Fn() {
    return [this](int, Message msg) {
      absl::MutexLock lock(&mu_);
      sent_.push_back(std::move(msg));
      return absl::OkStatus();
    };
  }
  // The oldest message not yet taken, waiting up to 5 s.
  std::optional<Message> Next() {
    absl::MutexLock lock(&mu_);
    auto any = [this]()
                   ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !sent_.empty(); };
    if (!mu_.AwaitWithTimeout(absl::Condition(&any), absl::Seconds(5)))
      return std::nullopt;
    Message m = std::move(sent_.front());
    sent_.erase(sent_.begin());
    return m;
  }
  // The next message that is a probe (or not), past at most one of the
  // other kind: a resend that the resend thread collected before the reply
  // that changed its kind can be sent just after it.
  std::optional<Message> NextThat(bool probe) {
    std::optional<Message> m = Next();
    if (m.has_value() && m->header.probe() != probe) m = Next();
    return m;
  }

 private:
  absl::Mutex mu_;
  std::vector<Message> sent_ ABSL_GUARDED_BY(mu_);
};

Message PushOf(uint64_t key, uint64_t seq, const std::vector<float>& values) {
  Message m;
  m.header.set_command(wire::KV_PUSH);
  m.header.mutable_slice()->set_key(key);
  m.header.set_push_seq(seq);
  AddFloatFrame(&m, Buffer::CopyOf(values.data(), values.size() * 4));
  return m;
}

// Issue #46: a push its server acknowledged (it holds it for its round) is
// resent as a probe, its header without frames or data; a probe answered
// send_whole (the server lost it) sends the push whole at once, and whole it
// stays until acknowledged again. A request that is not a push with data
// (a pull) is resent as it is, acknowledged or not.
TEST(RequestTrackerTest, AnAcknowledgedPushIsResentAsAHeaderOnlyProbe) {
  RequestTracker::Options options;
  options.resend_timeout = absl::Milliseconds(20);
  options.request_timeout = absl::Seconds(30);
  Recorder sent;
  RequestTracker tracker(options, sent.Fn(),
                         [](int node) { return std::to_string(node); });
  const uint64_t probes_before = tracker.probes();
  const uint64_t op = tracker.NewOp();
  tracker.Send(Req(op, ServerId(0), 0), PushOf(3, 5, {1, 2, 3, 4}));
  std::optional<Message> m = sent.Next();  // the first send
  ASSERT_TRUE(m.has_value());
  const uint64_t id = m->header.request_id();
  m = sent.Next();  // a resend, no acknowledgement yet: whole
  ASSERT_TRUE(m.has_value());
  EXPECT_FALSE(m->header.probe());
  EXPECT_EQ(m->data.size(), 1u);
  EXPECT_GE(tracker.whole_resends(), 1u);

  tracker.HandleReply(Reply(ServerId(0), id, /*ack_only=*/true));
  m = sent.NextThat(/*probe=*/true);
  ASSERT_TRUE(m.has_value());
  EXPECT_TRUE(m->header.probe()) << DebugString(*m);
  EXPECT_TRUE(m->data.empty());
  EXPECT_EQ(m->header.frames_size(), 0);
  EXPECT_EQ(m->header.request_id(), id);
  EXPECT_EQ(m->header.command(), wire::KV_PUSH);
  EXPECT_EQ(m->header.push_seq(), 5u);
  EXPECT_EQ(m->header.slice().key(), 3u);
  EXPECT_GT(tracker.probes(), probes_before);

  // The server lost it: the push goes whole at once (on the replying
  // thread), and its resends stay whole.
  Message lost = Reply(ServerId(0), id);
  lost.header.set_send_whole(true);
  const uint64_t whole_before = tracker.whole_resends();
  tracker.HandleReply(std::move(lost));
  m = sent.NextThat(/*probe=*/false);
  ASSERT_TRUE(m.has_value());
  EXPECT_FALSE(m->header.probe());
  EXPECT_EQ(m->data.size(), 1u);
  EXPECT_EQ(m->header.frames_size(), 1);
  EXPECT_EQ(m->header.request_id(), id);
  EXPECT_GT(tracker.whole_resends(), whole_before);
  m = sent.Next();
  ASSERT_TRUE(m.has_value());
  EXPECT_FALSE(m->header.probe());
  EXPECT_EQ(m->data.size(), 1u);

  // A restarted server (ResendNowTo) gets it whole, acknowledged or not.
  tracker.HandleReply(Reply(ServerId(0), id, /*ack_only=*/true));
  m = sent.NextThat(/*probe=*/true);
  ASSERT_TRUE(m.has_value());
  EXPECT_TRUE(m->header.probe());
  tracker.ResendNowTo(ServerId(0), absl::InfiniteFuture());
  m = sent.NextThat(/*probe=*/false);
  ASSERT_TRUE(m.has_value());
  EXPECT_FALSE(m->header.probe());
  EXPECT_EQ(m->data.size(), 1u);

  tracker.HandleReply(Reply(ServerId(0), id));
  EXPECT_TRUE(tracker.Wait(op, "push").ok());

  // A pull has nothing to leave out.
  const uint64_t pull = tracker.NewOp();
  Message pull_msg;
  pull_msg.header.set_command(wire::KV_PULL);
  tracker.Send(Req(pull, ServerId(0), 0), std::move(pull_msg));
  do {
    m = sent.Next();  // past what the push left in the recorder
  } while (m.has_value() && m->header.command() != wire::KV_PULL);
  ASSERT_TRUE(m.has_value());
  tracker.HandleReply(
      Reply(ServerId(0), m->header.request_id(), /*ack_only=*/true));
  m = sent.Next();
  ASSERT_TRUE(m.has_value());
  EXPECT_FALSE(m->header.probe());
  tracker.HandleReply(Reply(ServerId(0), m->header.request_id()));
  EXPECT_TRUE(tracker.Wait(pull, "pull").ok());
}

}  // namespace
}  // namespace tessera
