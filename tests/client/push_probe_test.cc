// Probes end to end (issue #46): a worker's RequestTracker and real KVServers
// in one process, every message delivered in order on one thread (a server's
// Handle is called from one thread), no sockets. A push its server
// acknowledged is resent as a header-only probe; when the server lost it (it
// restarted from a checkpoint taken before the push, and the worker has not
// heard of the restart yet) the probe is answered send_whole, the push goes
// again whole, and the round completes with the exact sum, each push applied
// once.
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/message.h"
#include "gtest/gtest.h"
#include "server/kv_server.h"
#include "worker/client/request_tracker.h"

namespace tessera {
namespace {

// Runs posted tasks in order on its own thread, until closed; what is
// posted after that is dropped.
class Wire {
 public:
  Wire() : thread_([this] { Run(); }) {}
  ~Wire() { Close(); }
  void Post(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    if (!stop_) tasks_.push_back(std::move(task));
  }
  void Close() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Run() {
    while (true) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return stop_ || !tasks_.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (stop_) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

Message SliceMessage(wire::Command cmd, int rank, uint64_t request_id) {
  Message m;
  m.header.set_command(cmd);
  m.header.set_sender(WorkerId(rank));
  m.header.set_request_id(request_id);
  m.header.set_plane(wire::DATA);
  wire::KeySlice* s = m.header.mutable_slice();
  s->set_key(7);
  s->set_length(2);
  s->set_total_length(2);
  return m;
}

Message WithValues(Message m, const std::vector<float>& values) {
  AddFloatFrame(&m, Buffer::CopyOf(values.data(), values.size() * 4));
  return m;
}

// Polls `done` every millisecond for up to 10 s.
bool Eventually(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST(PushProbeTest, APushLostByARestartedServerIsSentWholeAfterItsProbe) {
  Wire wire;
  std::unique_ptr<RequestTracker> tracker;
  // Replies to worker 0 go to its tracker; worker 1's are not looked at.
  auto to_workers = [&](int peer, Message msg) {
    msg.header.set_sender(ServerId(0));
    if (peer == WorkerId(0)) {
      wire.Post([&tracker, m = std::move(msg)]() mutable {
        tracker->HandleReply(std::move(m));
      });
    }
    return absl::OkStatus();
  };
  KVServer before(/*num_workers=*/2, /*num_threads=*/1, to_workers);
  KVServer restarted(/*num_workers=*/2, /*num_threads=*/1, to_workers);
  std::atomic<KVServer*> server{&before};

  Message init = WithValues(SliceMessage(wire::KV_INIT, 1, 1000), {0, 0});
  init.header.mutable_kv_options()->set_sync_mode(true);
  wire.Post(
      [&, m = std::move(init)]() mutable { before.Handle(std::move(m)); });
  // The checkpoint the restarted server comes back from: before the push.
  absl::Mutex mu;
  std::optional<wire::ServerCheckpoint> saved;
  wire.Post([&] {
    before.Snapshot([&](wire::ServerCheckpoint s) {
      absl::MutexLock lock(&mu);
      saved = std::move(s);
    });
  });
  ASSERT_TRUE(Eventually([&] {
    absl::MutexLock lock(&mu);
    return saved.has_value();
  }));
  ASSERT_EQ(saved->keys_size(), 1);
  ASSERT_TRUE(restarted.Restore(*saved).ok());

  RequestTracker::Options options;
  options.resend_timeout = absl::Milliseconds(20);
  options.request_timeout = absl::Seconds(30);
  tracker = std::make_unique<RequestTracker>(
      options,
      [&](int, Message msg) {
        msg.header.set_sender(WorkerId(0));
        wire.Post([&server, m = std::move(msg)]() mutable {
          server.load()->Handle(std::move(m));
        });
        return absl::OkStatus();
      },
      [](int node) { return std::to_string(node); });

  const uint64_t push = tracker->NewOp();
  RequestTracker::Request request;
  request.op = push;
  request.server = ServerId(0);
  tracker->Send(request, WithValues(SliceMessage(wire::KV_PUSH, 0, 0), {1, 2}));
  // Held for its round and acknowledged: probed for, header only.
  ASSERT_TRUE(Eventually([&] { return tracker->probes() >= 2; }));
  EXPECT_EQ(before.stats().pushes_applied(), 1u);
  EXPECT_EQ(before.stats().malformed_messages(), 0u);

  // The server restarts from its checkpoint; the worker has not heard.
  const uint64_t whole_before = tracker->whole_resends();
  server.store(&restarted);
  ASSERT_TRUE(
      Eventually([&] { return tracker->whole_resends() > whole_before; }));
  ASSERT_TRUE(Eventually([&] {
    return restarted.stats().pushes_applied() == 1;  // taken into its round
  }));
  Message other = WithValues(SliceMessage(wire::KV_PUSH, 1, 1001), {10, 20});
  wire.Post(
      [&, m = std::move(other)]() mutable { restarted.Handle(std::move(m)); });
  EXPECT_TRUE(tracker->Wait(push, "push").ok());

  float pulled[2] = {0, 0};
  const uint64_t pull = tracker->NewOp();
  request.op = pull;
  request.out = pulled;
  request.length = 2;
  Message pull_msg = SliceMessage(wire::KV_PULL, 0, 0);
  pull_msg.header.set_push_seq(1);  // after its push
  tracker->Send(request, std::move(pull_msg));
  EXPECT_TRUE(tracker->Wait(pull, "pull").ok());
  EXPECT_EQ(pulled[0], 11.0f);
  EXPECT_EQ(pulled[1], 22.0f);
  EXPECT_EQ(restarted.stats().pushes_applied(), 2u);
  EXPECT_EQ(restarted.stats().rounds_applied(), 1u);
  EXPECT_EQ(restarted.stats().malformed_messages(), 0u);
  EXPECT_EQ(before.stats().pushes_applied(), 1u);

  // The traffic stops before the tracker and the servers go.
  wire.Close();
  tracker.reset();
}

}  // namespace
}  // namespace tessera
