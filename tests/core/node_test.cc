// The control plane in one process over the in-memory transport: ids and ranks,
// and a scheduler with a server and workers that barrier and end.
#include "common/node.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <set>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "scheduler/scheduler.h"
#include "tests/support/forwarding_transport.h"
#include "tests/support/memory_network.h"

namespace tessera {
namespace {

wire::NodeInfo Info(wire::Role role, const std::string& host, int port) {
  wire::NodeInfo n;
  n.set_role(role);
  n.set_host(host);
  n.set_port(port);
  return n;
}

// AssignIds of `arrival`, checked to give the same table whatever the order the
// registrations came in (here: as given, and reversed).
std::vector<wire::NodeInfo> AssignedInAnyOrder(
    std::vector<wire::NodeInfo> arrival) {
  std::vector<wire::NodeInfo> a = AssignIds(arrival);
  std::reverse(arrival.begin(), arrival.end());
  std::vector<wire::NodeInfo> b = AssignIds(arrival);
  EXPECT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    EXPECT_EQ(a[i].SerializeAsString(), b[i].SerializeAsString());
  }
  return a;
}

// The node of `table` at host:port; id 0 and rank -100 when none is.
wire::NodeInfo Find(const std::vector<wire::NodeInfo>& table,
                    const std::string& host, int port) {
  for (const auto& n : table) {
    if (n.host() == host && n.port() == port) return n;
  }
  wire::NodeInfo none;
  none.set_rank(-100);
  return none;
}

TEST(AssignIdsTest, RanksFollowAddressesNotArrivalOrder) {
  std::vector<wire::NodeInfo> arrival = {
      Info(wire::WORKER, "10.0.0.2", 100), Info(wire::SERVER, "10.0.0.9", 1),
      Info(wire::WORKER, "10.0.0.1", 200), Info(wire::SERVER, "10.0.0.3", 5),
      Info(wire::WORKER, "10.0.0.1", 150)};
  std::vector<wire::NodeInfo> a = AssignedInAnyOrder(arrival);
  ASSERT_EQ(a.size(), 5u);
  auto find = [&a](const std::string& host, int port) {
    return Find(a, host, port);
  };
  EXPECT_EQ(find("10.0.0.3", 5).id(), 8);
  EXPECT_EQ(find("10.0.0.3", 5).rank(), 0);
  EXPECT_EQ(find("10.0.0.9", 1).id(), 10);
  EXPECT_EQ(find("10.0.0.1", 150).id(), 9);
  EXPECT_EQ(find("10.0.0.1", 200).id(), 11);
  EXPECT_EQ(find("10.0.0.2", 100).id(), 13);
  EXPECT_EQ(find("10.0.0.2", 100).rank(), 2);
}

// launch.py's start order (DMLC_TASK_ID, registered as the rank) wins over the
// address: its "worker 0" is rank 0 wherever it listens. Nodes without one
// (rank -1) come after, by address.
TEST(AssignIdsTest, RanksFollowTheLaunchersStartOrderBeforeAddresses) {
  auto ordered = [](wire::Role role, const std::string& host, int port,
                    int order) {
    wire::NodeInfo n = Info(role, host, port);
    n.set_rank(order);
    return n;
  };
  std::vector<wire::NodeInfo> arrival = {
      ordered(wire::WORKER, "127.0.0.1", 300, 3),
      ordered(wire::SERVER, "127.0.0.9", 1, 0),
      ordered(wire::WORKER, "127.0.0.3", 100, 2),
      ordered(wire::SERVER, "127.0.0.2", 5, 1),
      ordered(wire::WORKER, "127.0.0.0", 50, -1),
      ordered(wire::WORKER, "127.0.0.2", 200, 4)};
  std::vector<wire::NodeInfo> a = AssignedInAnyOrder(arrival);
  ASSERT_EQ(a.size(), 6u);
  auto rank_at = [&a](const std::string& host, int port) {
    return Find(a, host, port).rank();
  };
  EXPECT_EQ(rank_at("127.0.0.9", 1), 0);  // task 0: server 0
  EXPECT_EQ(rank_at("127.0.0.2", 5), 1);
  EXPECT_EQ(rank_at("127.0.0.3", 100), 0);  // task 2: launch.py's worker 0
  EXPECT_EQ(rank_at("127.0.0.1", 300), 1);
  EXPECT_EQ(rank_at("127.0.0.2", 200), 2);
  EXPECT_EQ(rank_at("127.0.0.0", 50), 3);  // none: after those with one
}

Options TestOptions(Role role) {
  Options o;
  o.role = role;
  o.root_uri = "127.0.0.1";
  o.root_port = 7000;
  o.num_servers = 1;
  o.num_workers = 2;
  o.heartbeat_interval = absl::Milliseconds(50);
  o.heartbeat_timeout = absl::Seconds(5);
  o.start_timeout = absl::Seconds(10);
  o.request_timeout = absl::Seconds(10);
  return o;
}

TEST(NodeTest, SchedulerServerAndWorkersBarrierAndEnd) {
  MemoryNetwork net;
  Scheduler scheduler(TestOptions(Role::kScheduler), net.NewTransport());
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });

  absl::Status server_result;
  std::thread server_thread([&] {
    absl::StatusOr<std::unique_ptr<Node>> node = Node::Start(
        TestOptions(Role::kServer), Node::Callbacks(), net.NewTransport());
    if (!node.ok()) {
      server_result = node.status();
      return;
    }
    server_result = (*node)->Barrier(kGroupServers | kGroupWorkers);
    if (server_result.ok()) server_result = (*node)->WaitForTerminate();
  });
  std::vector<int> ranks(2, -1);
  std::vector<absl::Status> results(2);
  std::vector<std::thread> workers;
  for (int i = 0; i < 2; ++i) {
    workers.emplace_back([&, i] {
      absl::StatusOr<std::unique_ptr<Node>> node = Node::Start(
          TestOptions(Role::kWorker), Node::Callbacks(), net.NewTransport());
      if (!node.ok()) {
        results[i] = node.status();
        return;
      }
      ranks[i] = (*node)->rank();
      for (int b = 0; b < 5 && results[i].ok(); ++b)
        results[i] = (*node)->Barrier(kGroupWorkers);
      if (results[i].ok())
        results[i] = (*node)->Barrier(kGroupServers | kGroupWorkers);
      if (results[i].ok()) results[i] = (*node)->Finish();
    });
  }
  for (std::thread& t : workers) t.join();
  server_thread.join();
  scheduler_thread.join();
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(results[1].ok()) << results[1];
  EXPECT_TRUE(server_result.ok()) << server_result;
  EXPECT_TRUE(scheduler_result.ok()) << scheduler_result;
  EXPECT_EQ(ranks[0] + ranks[1], 1) << "ranks 0 and 1";
}

TEST(NodeTest, NodeWithoutSchedulerGivesUpNamingItsAddress) {
  MemoryNetwork net;
  Options o = TestOptions(Role::kWorker);
  o.start_timeout =
      absl::Milliseconds(100);  // the node waits 5 s longer than this
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Node>> node =
      Node::Start(o, Node::Callbacks(), net.NewTransport());
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  ASSERT_FALSE(node.ok());
  EXPECT_EQ(node.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(node.status().message(),
              ::testing::HasSubstr(
                  "no node table from the scheduler at 127.0.0.1:7000"));
  EXPECT_THAT(node.status().message(),
              ::testing::HasSubstr("this node advertises 127.0.0.1:"));
}

// A transport that binds where asked but reports another port: the node then
// advertises an address nobody can reach, as a node on the wrong interface
// does.
// Advertises a port nobody listens on.
class MisadvertisingTransport : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  absl::StatusOr<int> Bind(const std::string& ip, int port) override {
    absl::StatusOr<int> bound = inner_->Bind(ip, port);
    if (!bound.ok()) return bound;
    return *bound + 1000;
  }
};

// Loses the first `drops` messages of `command` it receives, as a connection
// killed under them would.
class DroppingTransport : public ForwardingTransport {
 public:
  DroppingTransport(std::unique_ptr<Transport> inner, wire::Command command,
                    int drops)
      : ForwardingTransport(std::move(inner)),
        command_(command),
        drops_(drops) {}
  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    while (true) {
      absl::StatusOr<Message> msg = inner_->Receive(timeout);
      if (!msg.ok() || msg->header.command() != command_ ||
          msg->header.is_response() || drops_.load() == 0) {
        return msg;
      }
      --drops_;
      ++dropped_;
    }
  }
  // Drops the next `n` messages of the command (on top of those left).
  void DropNext(int n) { drops_ += n; }
  int dropped() const { return dropped_.load(); }

 private:
  const wire::Command command_;
  std::atomic<int> drops_;
  std::atomic<int> dropped_{0};
};

TEST(NodeTest, LostNodeTableIsAskedForAgain) {
  MemoryNetwork net;
  Options options = TestOptions(Role::kScheduler);
  options.resend_timeout = absl::Milliseconds(50);
  Scheduler scheduler(options, net.NewTransport());
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });
  const absl::Time start = absl::Now();
  std::vector<absl::Status> results(3);
  std::vector<std::thread> nodes;
  for (int i = 0; i < 3; ++i) {
    nodes.emplace_back([&, i, options] {
      Options mine = options;
      mine.role = i == 0 ? Role::kServer : Role::kWorker;
      // Worker 1 loses the table the scheduler sends when the job forms.
      absl::StatusOr<std::unique_ptr<Node>> node =
          Node::Start(mine, Node::Callbacks(),
                      std::make_unique<DroppingTransport>(
                          net.NewTransport(), wire::NODE_TABLE, i == 1));
      if (!node.ok()) {
        results[i] = node.status();
        return;
      }
      results[i] = i == 0 ? (*node)->WaitForTerminate()
                          : (*node)->Barrier(kGroupWorkers);
      if (i != 0 && results[i].ok()) results[i] = (*node)->Finish();
    });
  }
  for (std::thread& t : nodes) t.join();
  scheduler_thread.join();
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
  EXPECT_TRUE(scheduler_result.ok()) << scheduler_result;
  // Asked again after 50 ms, not at the 10 s start deadline.
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(NodeTest, LostBarrierRepliesAreAskedForAgainAndCountedOnce) {
  MemoryNetwork net;
  Options options = TestOptions(Role::kScheduler);
  options.resend_timeout = absl::Milliseconds(50);
  Scheduler scheduler(options, net.NewTransport());
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });
  const absl::Time start = absl::Now();
  std::vector<absl::Status> results(3);
  // entered[w]: barriers worker w has entered. A barrier released to one
  // worker before the other entered it would show a repeat counted twice.
  std::atomic<int> entered[2] = {0, 0};
  std::atomic<int> early_releases{0};
  std::vector<std::thread> nodes;
  for (int i = 0; i < 3; ++i) {
    nodes.emplace_back([&, i, options] {
      Options mine = options;
      mine.role = i == 0 ? Role::kServer : Role::kWorker;
      // Only one worker loses releases (two of its five): each makes it ask
      // again for a barrier that was already released.
      absl::StatusOr<std::unique_ptr<Node>> node =
          Node::Start(mine, Node::Callbacks(),
                      std::make_unique<DroppingTransport>(
                          net.NewTransport(), wire::BARRIER, i == 1 ? 2 : 0));
      if (!node.ok()) {
        results[i] = node.status();
        return;
      }
      if (i == 0) {
        results[i] = (*node)->WaitForTerminate();
        return;
      }
      const int me = i - 1;
      for (int b = 1; b <= 5 && results[i].ok(); ++b) {
        entered[me] = b;
        results[i] = (*node)->Barrier(kGroupWorkers);
        if (entered[1 - me].load() < b) ++early_releases;
      }
      if (results[i].ok()) results[i] = (*node)->Finish();
    });
  }
  for (std::thread& t : nodes) t.join();
  scheduler_thread.join();
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
  EXPECT_TRUE(scheduler_result.ok()) << scheduler_result;
  EXPECT_EQ(early_releases.load(), 0);
  // Two lost releases each, re-asked after 50 ms then 100 ms: well under the
  // 10 s request_timeout.
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A scheduler running on a thread of its own.
class SchedulerThread {
 public:
  SchedulerThread(MemoryNetwork& net, const Options& options)
      : scheduler_(options, net.NewTransport()) {
    bound_ = scheduler_.Bind().ok();
    thread_ = std::thread([this] { result_ = scheduler_.Run(); });
  }
  ~SchedulerThread() {
    if (thread_.joinable()) thread_.join();
  }
  bool bound() const { return bound_; }
  absl::Status Join() {
    thread_.join();
    return result_;
  }

 private:
  Scheduler scheduler_;
  bool bound_ = false;
  absl::Status result_;
  std::thread thread_;
};

// Options for the end-of-job tests: resends after 50 ms, so a lost message is
// repeated well inside the heartbeat time-out.
Options EndOptions(Role role) {
  Options o = TestOptions(role);
  o.resend_timeout = absl::Milliseconds(50);
  return o;
}

// One server and two workers over `net`; node i (0: the server) receives
// through `transport(i)`. The server waits for the end (after `server_hook`
// ran on its Node); the workers barrier and finish.
std::vector<absl::Status> RunJob(
    MemoryNetwork& net, const Options& options,
    const std::function<std::unique_ptr<Transport>(int)>& transport,
    const std::function<void(Node&)>& server_hook = nullptr) {
  std::vector<absl::Status> results(3);
  std::vector<std::thread> nodes;
  for (int i = 0; i < 3; ++i) {
    nodes.emplace_back([&, i] {
      Options mine = options;
      mine.role = i == 0 ? Role::kServer : Role::kWorker;
      absl::StatusOr<std::unique_ptr<Node>> node =
          Node::Start(mine, Node::Callbacks(), transport(i));
      if (!node.ok()) {
        results[i] = node.status();
        return;
      }
      if (i == 0) {
        if (server_hook) server_hook(**node);
        results[i] = (*node)->WaitForTerminate();
        return;
      }
      results[i] = (*node)->Barrier(kGroupWorkers);
      if (results[i].ok()) results[i] = (*node)->Finish();
    });
  }
  for (std::thread& t : nodes) t.join();
  return results;
}

TEST(NodeTest, LostTerminateIsSentAgainAndTheJobEndsOkEverywhere) {
  MemoryNetwork net;
  const Options options = EndOptions(Role::kScheduler);
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  const absl::Time start = absl::Now();
  // The server and worker 1 each lose the first TERMINATE, as a connection
  // killed under it loses it.
  std::vector<absl::Status> results =
      RunJob(net, options, [&](int i) -> std::unique_ptr<Transport> {
        return std::make_unique<DroppingTransport>(net.NewTransport(),
                                                   wire::TERMINATE, i != 2);
      });
  EXPECT_TRUE(scheduler.Join().ok());
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
  // Sent again after 50 ms; without that the server would wait out its 5 s
  // heartbeat time-out and fail.
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
}

// Holds each acknowledgement of an end-of-job notice for 300 ms before it
// goes, as a busy machine may delay the thread that sends it; a send after
// Close is lost.
class SlowAckTransport : public ForwardingTransport {
 public:
  explicit SlowAckTransport(std::unique_ptr<Transport> inner)
      : ForwardingTransport(std::move(inner)) {}
  absl::Status Send(int peer, const Message& msg) override {
    const wire::Command c = msg.header.command();
    if (msg.header.is_response() &&
        (c == wire::TERMINATE || c == wire::ABORT || c == wire::NODE_DEAD)) {
      absl::SleepFor(absl::Milliseconds(300));
      if (closed_.load()) return absl::CancelledError("closed");
    }
    return inner_->Send(peer, msg);
  }
  void Close() override {
    closed_.store(true);
    inner_->Close();
  }

 private:
  std::atomic<bool> closed_{false};
};

// A node acknowledges TERMINATE before the thread waiting for the end can see
// it and close the transport: otherwise a slow acknowledgement is lost and
// the scheduler waits out its deadline (PS_HEARTBEAT_TIMEOUT, 5 s here) for
// every node that lost the race. Seen with many processes on one machine.
TEST(NodeTest, TerminateIsAcknowledgedBeforeTheNodeMayClose) {
  MemoryNetwork net;
  const Options options = EndOptions(Role::kScheduler);
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  const absl::Time start = absl::Now();
  std::vector<absl::Status> results =
      RunJob(net, options, [&](int) -> std::unique_ptr<Transport> {
        return std::make_unique<SlowAckTransport>(net.NewTransport());
      });
  EXPECT_TRUE(scheduler.Join().ok());
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
  // Every acknowledgement arrives after 300 ms; the scheduler's deadline for
  // a missing one is 5 s.
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(NodeTest, FinishedWorkerThatNeverHearsTheEndLeavesWithoutFailure) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.heartbeat_timeout = absl::Seconds(1);
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  const absl::Time start = absl::Now();
  // Worker 2 loses every TERMINATE: the scheduler leaves after its deadline
  // (PS_HEARTBEAT_TIMEOUT, 1 s), and the worker, counted done, then hears
  // nothing for its own time-out.
  std::vector<absl::Status> results =
      RunJob(net, options, [&](int i) -> std::unique_ptr<Transport> {
        return std::make_unique<DroppingTransport>(
            net.NewTransport(), wire::TERMINATE, i == 2 ? 1000 : 0);
      });
  EXPECT_TRUE(scheduler.Join().ok());
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(NodeTest, ServerCutOffFromTheEndFailsUnlessItsPartIsDone) {
  for (const bool part_done : {false, true}) {
    SCOPED_TRACE(part_done ? "part done" : "part not done");
    MemoryNetwork net;
    Options options = EndOptions(Role::kScheduler);
    options.heartbeat_timeout = absl::Seconds(1);
    SchedulerThread scheduler(net, options);
    ASSERT_TRUE(scheduler.bound());
    std::vector<absl::Status> results = RunJob(
        net, options,
        [&](int i) -> std::unique_ptr<Transport> {
          return std::make_unique<DroppingTransport>(
              net.NewTransport(), wire::TERMINATE, i == 0 ? 1000 : 0);
        },
        [&](Node& server) {
          if (part_done) server.MarkPartDone();
        });
    EXPECT_TRUE(scheduler.Join().ok());
    EXPECT_TRUE(results[1].ok()) << results[1];
    EXPECT_TRUE(results[2].ok()) << results[2];
    if (part_done) {
      EXPECT_TRUE(results[0].ok()) << results[0];
    } else {
      // It cannot tell a finished job from a dead scheduler.
      EXPECT_EQ(results[0].code(), absl::StatusCode::kUnavailable);
      EXPECT_THAT(std::string(results[0].message()),
                  ::testing::HasSubstr("stopped answering heartbeats"));
    }
  }
}

// Issue #12: a thread waiting for a reply receives it itself. The node's
// receiver thread steps aside when a caller asks (on_receiver_free), the
// caller then receives, the node's own waits (barrier, end) are served, and a
// stopped node answers kClosed.
TEST(NodeTest, CallerReceivesInTurnWithTheReceiverThread) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.num_workers = 1;
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  absl::Status server_result;
  std::thread server([&] {
    Options mine = options;
    mine.role = Role::kServer;
    absl::StatusOr<std::unique_ptr<Node>> node =
        Node::Start(mine, Node::Callbacks(), net.NewTransport());
    server_result = node.ok() ? (*node)->WaitForTerminate() : node.status();
  });

  absl::Mutex mu;
  int freed = 0;  // on_receiver_free calls
  Node::Callbacks callbacks;
  callbacks.on_receiver_free = [&] {
    absl::MutexLock lock(&mu);
    ++freed;
  };
  Options mine = options;
  mine.role = Role::kWorker;
  absl::StatusOr<std::unique_ptr<Node>> started =
      Node::Start(mine, std::move(callbacks), net.NewTransport());
  ASSERT_TRUE(started.ok()) << started.status();
  Node& node = **started;
  using R = Node::ReceiveResult;
  // While the receiver thread holds the transport a caller is told it is
  // busy; the thread steps aside after its current receive and says so, and
  // the caller then receives. A caller that got the transport first lets the
  // thread take it back (after the grace) and tries again.
  bool busy = false, received_here = false;
  for (int attempt = 0; attempt < 50 && !received_here; ++attempt) {
    int seen;
    {
      absl::MutexLock lock(&mu);
      seen = freed;
    }
    const R r = node.ReceiveOnCaller(absl::Milliseconds(1));
    ASSERT_NE(r, R::kClosed);
    if (r != R::kBusy) {
      received_here = busy;
      if (!busy) absl::SleepFor(Node::kCallerGrace * 4);
      continue;
    }
    busy = true;
    absl::MutexLock lock(&mu);
    auto stepped_aside = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return freed > seen;
    };
    EXPECT_TRUE(
        mu.AwaitWithTimeout(absl::Condition(&stepped_aside), absl::Seconds(2)));
  }
  EXPECT_TRUE(busy);
  EXPECT_TRUE(received_here);
  // The node's own waits are served although a caller received last.
  const absl::Time start = absl::Now();
  EXPECT_TRUE(node.Barrier(kGroupWorkers).ok());
  EXPECT_TRUE(node.Finish().ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  node.Stop();
  EXPECT_EQ(node.ReceiveOnCaller(absl::Milliseconds(1)), R::kClosed);
  server.join();
  EXPECT_TRUE(server_result.ok()) << server_result;
  EXPECT_TRUE(scheduler.Join().ok());
}

TEST(NodeTest, LostAbortIsSentAgainSoTheNodeHearsWhy) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.start_timeout = absl::Seconds(1);
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  // Only one of the two workers comes; it loses the first ABORT.
  Options mine = options;
  mine.role = Role::kWorker;
  absl::StatusOr<std::unique_ptr<Node>> node = Node::Start(
      mine, Node::Callbacks(),
      std::make_unique<DroppingTransport>(net.NewTransport(), wire::ABORT, 1));
  ASSERT_FALSE(node.ok());
  EXPECT_EQ(node.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(node.status().message()),
              ::testing::HasSubstr("1 of 2 worker(s) and 1 of 1 server(s) "
                                   "never registered"));
  EXPECT_EQ(scheduler.Join().code(), absl::StatusCode::kDeadlineExceeded);
}

// A node restarted at the same address before the job formed registers
// again with a nonce of its own (issue #46's review): the scheduler takes
// it as the same registration, and the start-up deadline's abort names both
// processes' registrations, so the new one hears why.
TEST(NodeTest, ANodeRestartedBeforeTheJobFormedHearsTheStartUpAbort) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.start_timeout = absl::Seconds(2);
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  Options mine = options;
  mine.role = Role::kWorker;
  mine.port = 30300;
  mine.start_timeout = absl::Milliseconds(300);
  absl::StatusOr<std::unique_ptr<Node>> first =
      Node::Start(mine, Node::Callbacks(), net.NewTransport());
  ASSERT_FALSE(first.ok());  // gave up before the job could form
  mine.start_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Node>> second =
      Node::Start(mine, Node::Callbacks(), net.NewTransport());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAborted)
      << second.status();
  EXPECT_THAT(std::string(second.status().message()),
              ::testing::HasSubstr("never registered"));
  EXPECT_EQ(scheduler.Join().code(), absl::StatusCode::kDeadlineExceeded);
}

// Drops the first abort that names this node's registration (its nonce,
// read from the REGISTER it sends); `dropped` says whether it did (shared:
// a node that fails to start destroys its transport).
class FirstOwnAbortDropped : public ForwardingTransport {
 public:
  FirstOwnAbortDropped(std::unique_ptr<Transport> inner,
                       std::shared_ptr<std::atomic<bool>> dropped)
      : ForwardingTransport(std::move(inner)), dropped_(std::move(dropped)) {}
  absl::Status Send(int peer, const Message& msg) override {
    if (msg.header.command() == wire::REGISTER)
      nonce_ = msg.header.register_().nonce();
    return inner_->Send(peer, msg);
  }
  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    while (true) {
      absl::StatusOr<Message> msg = inner_->Receive(timeout);
      if (!msg.ok() || msg->header.command() != wire::ABORT ||
          dropped_->load() ||
          !absl::c_linear_search(msg->header.abort().registrations(),
                                 nonce_.load())) {
        return msg;
      }
      dropped_->store(true);
    }
  }

 private:
  std::atomic<uint64_t> nonce_{0};
  const std::shared_ptr<std::atomic<bool>> dropped_;
};

// A node restarted at a registered address after the start-up deadline
// ended the job is told the end naming its registration; when that abort is
// lost it asks again, and is told again (review of issue #46's fix: the
// scheduler answered only a registration's first nonce, and the node waited
// out its own deadline).
TEST(NodeTest, ARestartWhoseStartUpAbortWasLostHearsItWhenItAsksAgain) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.start_timeout = absl::Milliseconds(500);
  options.heartbeat_timeout = absl::Seconds(10);  // the end waits for acks
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  // A registered server that never hears the end keeps the scheduler
  // resending it, as a node it cannot reach would.
  Options server_options = options;
  server_options.role = Role::kServer;
  server_options.start_timeout = absl::Seconds(4);
  std::thread server([&] {
    EXPECT_FALSE(Node::Start(server_options, Node::Callbacks(),
                             std::make_unique<DroppingTransport>(
                                 net.NewTransport(), wire::ABORT, 1000))
                     .ok());
  });
  Options mine = options;
  mine.role = Role::kWorker;
  mine.port = 30310;
  mine.start_timeout = absl::Milliseconds(200);
  ASSERT_FALSE(Node::Start(mine, Node::Callbacks(), net.NewTransport()).ok());
  absl::SleepFor(absl::Milliseconds(800));  // the job ended, never formed
  mine.start_timeout = absl::Seconds(5);
  auto dropped = std::make_shared<std::atomic<bool>>(false);
  auto transport =
      std::make_unique<FirstOwnAbortDropped>(net.NewTransport(), dropped);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Node>> second =
      Node::Start(mine, Node::Callbacks(), std::move(transport));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAborted)
      << second.status();
  EXPECT_THAT(std::string(second.status().message()),
              ::testing::HasSubstr("never registered"));
  EXPECT_TRUE(dropped->load());
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  server.join();
  EXPECT_EQ(scheduler.Join().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(NodeTest, LostNodeDeadIsSentAgainSoTheNodeHearsWhoDied) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.num_workers = 1;
  options.heartbeat_timeout = absl::Milliseconds(500);
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  Options server_options = options;
  server_options.role = Role::kServer;
  // The server goes silent (it stops sending heartbeats) soon after joining.
  std::thread server([&] {
    absl::StatusOr<std::unique_ptr<Node>> node =
        Node::Start(server_options, Node::Callbacks(), net.NewTransport());
    ASSERT_TRUE(node.ok()) << node.status();
    (*node)->Stop();
  });
  Options worker_options = options;
  worker_options.role = Role::kWorker;
  worker_options.heartbeat_timeout = absl::Seconds(5);  // not its own finding
  absl::StatusOr<std::unique_ptr<Node>> worker =
      Node::Start(worker_options, Node::Callbacks(),
                  std::make_unique<DroppingTransport>(net.NewTransport(),
                                                      wire::NODE_DEAD, 1));
  server.join();
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::Status result = (*worker)->WaitForTerminate();
  EXPECT_EQ(result.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(result.message()),
              ::testing::HasSubstr("server 0 (id 8 at 127.0.0.1:"));
  EXPECT_THAT(std::string(result.message()),
              ::testing::HasSubstr("stopped heart-beating"));
  EXPECT_EQ(scheduler.Join().code(), absl::StatusCode::kUnavailable);
}

TEST(NodeTest, LostTableAfterARestartIsSentAgain) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.num_workers = 1;
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  Options server_options = options;
  server_options.role = Role::kServer;
  server_options.port = 30000;  // a restarted server comes back here
  absl::StatusOr<std::unique_ptr<Node>> server;
  std::thread first([&] {
    server = Node::Start(server_options, Node::Callbacks(), net.NewTransport());
  });
  // The worker loses the first table after formation: the one announcing
  // the server's restart.
  absl::Mutex mu;
  std::vector<int> restarted;
  Node::Callbacks callbacks;
  callbacks.on_peer_restart = [&](int peer) {
    absl::MutexLock lock(&mu);
    restarted.push_back(peer);
  };
  Options worker_options = options;
  worker_options.role = Role::kWorker;
  auto transport = std::make_unique<DroppingTransport>(net.NewTransport(),
                                                       wire::NODE_TABLE, 0);
  DroppingTransport* dropping = transport.get();
  absl::StatusOr<std::unique_ptr<Node>> worker =
      Node::Start(worker_options, callbacks, std::move(transport));
  first.join();
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE(server.ok()) << server.status();
  dropping->DropNext(1);
  (*server)->Stop();
  server->reset();
  server_options.restart_count = 1;
  absl::StatusOr<std::unique_ptr<Node>> second =
      Node::Start(server_options, Node::Callbacks(), net.NewTransport());
  ASSERT_TRUE(second.ok()) << second.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  bool seen = false;
  while (!seen && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    absl::MutexLock lock(&mu);
    seen = !restarted.empty();
  }
  ASSERT_TRUE(seen) << "the worker never learned of the server's restart";
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(restarted, std::vector<int>{ServerId(0)});
  }
  EXPECT_EQ(dropping->dropped(), 1);
  EXPECT_TRUE((*worker)->Finish().ok());
  EXPECT_TRUE((*second)->WaitForTerminate().ok());
  EXPECT_TRUE(scheduler.Join().ok());
}

// Reports a sealed node key of the test's choosing (the in-memory network
// seals nothing; the scheduler only compares the keys nodes register with).
class KeyedTransport : public ForwardingTransport {
 public:
  KeyedTransport(std::unique_ptr<Transport> inner, char fill)
      : ForwardingTransport(std::move(inner)), key_(32, fill) {}
  KeyedTransport(std::unique_ptr<Transport> inner, std::string key)
      : ForwardingTransport(std::move(inner)), key_(std::move(key)) {}
  std::string node_key() const override { return key_; }

 private:
  const std::string key_;
};

// Starts a node of `role` at `port` over `net` (without callbacks) whose
// transport reports the sealed node key `key`.
absl::StatusOr<std::unique_ptr<Node>> StartKeyed(MemoryNetwork& net,
                                                 Options options, Role role,
                                                 int port, std::string key,
                                                 absl::Duration timeout,
                                                 bool spare = false) {
  options.role = role;
  options.port = port;
  options.start_timeout = timeout;
  options.spare = spare;
  return Node::Start(
      options, Node::Callbacks(),
      std::make_unique<KeyedTransport>(net.NewTransport(), std::move(key)));
}

// A registration or a restart claiming a sealed node key that another node
// (or the scheduler) holds is ignored: its peers would otherwise take the
// holder's records as the claimer's and drop them, cutting the holder off.
TEST(NodeTest, ARegistrationClaimingAnotherNodesSealedKeyIsIgnored) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.heartbeat_timeout = absl::Seconds(30);  // the dead server waits
  Scheduler scheduler(
      options, std::make_unique<KeyedTransport>(net.NewTransport(), 'S'));
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });
  auto start = [&](Role role, int port, int restart_count, char key,
                   absl::Duration timeout, const Node::Callbacks& callbacks) {
    Options mine = options;
    mine.role = role;
    mine.port = port;
    mine.restart_count = restart_count;
    mine.start_timeout = timeout;
    return Node::Start(
        mine, callbacks,
        std::make_unique<KeyedTransport>(net.NewTransport(), key));
  };
  absl::Mutex mu;
  std::vector<int> restarted;
  Node::Callbacks watch;
  watch.on_peer_restart = [&](int peer) {
    absl::MutexLock lock(&mu);
    restarted.push_back(peer);
  };
  // Before the job forms: worker B claims worker A's key ('A') and is not
  // counted; worker C completes the job.
  absl::StatusOr<std::unique_ptr<Node>> server, a, b, c;
  std::thread ts([&] {
    server = start(Role::kServer, 30000, 0, 'V', absl::Seconds(10), watch);
  });
  std::thread ta([&] {
    a = start(Role::kWorker, 30001, 0, 'A', absl::Seconds(10), watch);
  });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time b_start = absl::Now();
  b = start(Role::kWorker, 30002, 0, 'A', absl::Seconds(1), watch);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kDeadlineExceeded)
      << b.status();
  EXPECT_LT(absl::Now() - b_start, absl::Seconds(5));
  c = start(Role::kWorker, 30003, 0, 'C', absl::Seconds(10), watch);
  ts.join();
  ta.join();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(c.ok()) << c.status();
  // The server dies; its restarts claim worker A's key, then the
  // scheduler's: both are ignored and nobody hears of a restart. Its own
  // restart with a key of its own is announced.
  (*server)->Stop();
  server->reset();
  for (char claimed : {'A', 'S'}) {
    absl::StatusOr<std::unique_ptr<Node>> rogue =
        start(Role::kServer, 30000, 1, claimed, absl::Seconds(1), watch);
    EXPECT_EQ(rogue.status().code(), absl::StatusCode::kDeadlineExceeded)
        << "claiming key " << claimed << ": " << rogue.status();
  }
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(restarted.empty());
  }
  absl::StatusOr<std::unique_ptr<Node>> second =
      start(Role::kServer, 30000, 1, 'W', absl::Seconds(10), watch);
  ASSERT_TRUE(second.ok()) << second.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  size_t heard = 0;
  while (heard < 2 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    absl::MutexLock lock(&mu);
    heard = restarted.size();
  }
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(restarted, (std::vector<int>{ServerId(0), ServerId(0)}))
        << "both workers hear of the real restart";
  }
  std::thread fa([&] { EXPECT_TRUE((*a)->Finish().ok()); });
  EXPECT_TRUE((*c)->Finish().ok());
  fa.join();
  EXPECT_TRUE((*second)->WaitForTerminate().ok());
  scheduler_thread.join();
  EXPECT_TRUE(scheduler_result.ok()) << scheduler_result;
}

// A sealed node key is 32 bytes, canonical and not of small order: X25519
// ignores bit 255 and reduces mod 2^255 - 19, so a byte-different twin of a
// node's key would agree the same secrets, and a key of small order agrees
// zero with everyone. Registrations with such keys are ignored (issue #46);
// the job forms with the nodes whose keys are sound.
TEST(NodeTest, ANonCanonicalOrSmallOrderNodeKeyTakesNoPlace) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  Scheduler scheduler(
      options, std::make_unique<KeyedTransport>(net.NewTransport(), 'S'));
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });
  auto start = [&](Role role, int port, const std::string& key,
                   absl::Duration timeout) {
    return StartKeyed(net, options, role, port, key, timeout);
  };
  const std::string a(32, 'A');
  std::string twin = a;  // bit 255 set
  twin[31] = static_cast<char>(0x41 | 0x80);
  std::string p(32, '\xff');  // 2^255 - 19
  p[0] = '\xed';
  p[31] = '\x7f';
  const std::string zero(32, '\0');  // of small order
  absl::StatusOr<std::unique_ptr<Node>> server, worker_a, worker_c;
  std::thread ts([&] {
    server =
        start(Role::kServer, 30030, std::string(32, 'V'), absl::Seconds(10));
  });
  std::thread ta(
      [&] { worker_a = start(Role::kWorker, 30031, a, absl::Seconds(10)); });
  absl::SleepFor(absl::Milliseconds(300));
  int port = 30032;
  for (const std::string& bad : {twin, p, zero, std::string(31, 'B')}) {
    absl::StatusOr<std::unique_ptr<Node>> rogue =
        start(Role::kWorker, port++, bad, absl::Milliseconds(700));
    EXPECT_EQ(rogue.status().code(), absl::StatusCode::kDeadlineExceeded)
        << "key of " << bad.size() << " bytes ending in "
        << static_cast<int>(static_cast<uint8_t>(bad.back())) << ": "
        << rogue.status();
  }
  worker_c =
      start(Role::kWorker, 30040, std::string(32, 'C'), absl::Seconds(10));
  ts.join();
  ta.join();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(worker_a.ok()) << worker_a.status();
  ASSERT_TRUE(worker_c.ok()) << worker_c.status();
  std::thread fa([&] { EXPECT_TRUE((*worker_a)->Finish().ok()); });
  EXPECT_TRUE((*worker_c)->Finish().ok());
  fa.join();
  EXPECT_TRUE((*server)->WaitForTerminate().ok());
  scheduler_thread.join();
  EXPECT_TRUE(scheduler_result.ok()) << scheduler_result;
}

// A spare's key stays its own after the job forms (the index of sealed keys
// was rebuilt from the job's nodes only, dropping waiting spares' keys): a
// later registration claiming it is ignored, not merely turned away as late.
TEST(NodeTest, AWaitingSparesKeyStaysItsOwnAfterTheJobForms) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.num_servers = 2;
  options.replicas = 2;
  options.num_workers = 1;
  Scheduler scheduler(
      options, std::make_unique<KeyedTransport>(net.NewTransport(), 'S'));
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });
  auto start = [&](Role role, int port, char key, bool spare,
                   absl::Duration timeout) {
    return StartKeyed(net, options, role, port, std::string(32, key), timeout,
                      spare);
  };
  absl::StatusOr<std::unique_ptr<Node>> spare, s0, s1, worker;
  std::thread tspare([&] {
    spare = start(Role::kServer, 30050, 'P', true, absl::Seconds(10));
  });
  absl::SleepFor(absl::Milliseconds(200));
  std::thread t0(
      [&] { s0 = start(Role::kServer, 30051, 'V', false, absl::Seconds(10)); });
  std::thread t1(
      [&] { s1 = start(Role::kServer, 30052, 'U', false, absl::Seconds(10)); });
  worker = start(Role::kWorker, 30053, 'A', false, absl::Seconds(10));
  t0.join();
  t1.join();
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE(s0.ok()) << s0.status();
  ASSERT_TRUE(s1.ok()) << s1.status();
  // Formed. A late worker claiming the spare's key: ignored (its start
  // waits out its deadline), where a late worker of its own key is told the
  // job has formed.
  absl::StatusOr<std::unique_ptr<Node>> claimer =
      start(Role::kWorker, 30054, 'P', false, absl::Milliseconds(700));
  EXPECT_EQ(claimer.status().code(), absl::StatusCode::kDeadlineExceeded)
      << claimer.status();
  absl::StatusOr<std::unique_ptr<Node>> late =
      start(Role::kWorker, 30055, 'L', false, absl::Milliseconds(700));
  EXPECT_NE(late.status().code(), absl::StatusCode::kDeadlineExceeded)
      << late.status();
  EXPECT_FALSE(late.ok());
  EXPECT_TRUE((*worker)->Finish().ok());
  EXPECT_TRUE((*s0)->WaitForTerminate().ok());
  EXPECT_TRUE((*s1)->WaitForTerminate().ok());
  tspare.join();
  EXPECT_EQ(spare.status().code(), absl::StatusCode::kCancelled)
      << spare.status();
  scheduler_thread.join();
  EXPECT_TRUE(scheduler_result.ok()) << scheduler_result;
}

// Issue #46: the scheduler answers a registration it turns away with an
// ABORT sent to the address the registration names, and a compromised node
// (with keys of its role, in a TESSERA_AUTH_ONLY=1 job: the abort is not
// sealed to the named node's key) can name another node's address. The
// job's members are safe (a registration at a registered address is a
// duplicate), a waiting spare was not. Such an abort must end no other
// node: a node with an id takes only aborts sent to its id, one without
// (registering, or a spare) only those naming its registration. A rogue
// registers as a third server naming the spare's address (too many
// servers), then, once the job formed, as a worker naming it again (the job
// is formed): the spare is told neither and waits until the job's end.
TEST(NodeTest, ATurnedAwayRegistrationNamingASparesAddressEndsNoOne) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.num_servers = 2;
  options.replicas = 2;
  options.num_workers = 1;
  SchedulerThread scheduler(net, options);
  ASSERT_TRUE(scheduler.bound());
  auto start = [&](Role role, int port, bool spare) {
    Options mine = options;
    mine.role = role;
    mine.port = port;
    mine.spare = spare;
    return Node::Start(mine, Node::Callbacks(), net.NewTransport());
  };
  absl::StatusOr<std::unique_ptr<Node>> spare, s0, s1, worker;
  std::thread tspare([&] { spare = start(Role::kServer, 30250, true); });
  std::thread t0([&] { s0 = start(Role::kServer, 30251, false); });
  std::thread t1([&] { s1 = start(Role::kServer, 30252, false); });
  absl::SleepFor(absl::Milliseconds(300));  // all three registered

  std::unique_ptr<Transport> rogue = net.NewTransport();
  ASSERT_TRUE(rogue->Bind("127.0.0.1", 30299).ok());
  ASSERT_TRUE(rogue->Connect(kSchedulerId, "127.0.0.1", 7000).ok());
  auto register_as = [&](wire::Role role) {
    Message reg;
    reg.header.set_command(wire::REGISTER);
    reg.header.set_plane(wire::CONTROL);
    wire::NodeInfo* info = reg.header.mutable_register_()->mutable_node();
    info->set_role(role);
    info->set_rank(-1);
    info->set_host("127.0.0.1");
    info->set_port(30250);  // the spare's
    reg.header.mutable_register_()->set_nonce(12345);
    return rogue->Send(kSchedulerId, reg);
  };
  ASSERT_TRUE(register_as(wire::SERVER).ok());  // one server too many
  absl::SleepFor(absl::Milliseconds(300));
  worker = start(Role::kWorker, 30253, false);
  t0.join();
  t1.join();
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE(s0.ok()) << s0.status();
  ASSERT_TRUE(s1.ok()) << s1.status();
  ASSERT_TRUE(register_as(wire::WORKER).ok());  // the job has formed
  absl::SleepFor(absl::Milliseconds(300));

  const absl::Status finished = (*worker)->Finish();
  EXPECT_TRUE(finished.ok()) << finished;
  EXPECT_TRUE((*s0)->WaitForTerminate().ok());
  EXPECT_TRUE((*s1)->WaitForTerminate().ok());
  tspare.join();
  // Told of the job's end, as a spare never needed is (not aborted by the
  // rogue's turn-aways: "too many servers", "already formed").
  EXPECT_EQ(spare.status().code(), absl::StatusCode::kCancelled)
      << spare.status();
  EXPECT_TRUE(scheduler.Join().ok());
  rogue->Close();
}

// Says every node of the job has a key of its own (launch.py's jobs) while
// carrying no connection key, as a registration that got past the
// transport's checks would (the in-memory network has no keys).
class RosterTransport : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  bool nodes_have_own_keys() const override { return true; }
};

// Where every node has a key of its own, a registration without its
// connection's key names no node: it is ignored and takes no place in the
// job (issue #46; the transport drops such registrations before, so this is
// the scheduler's own check).
TEST(NodeTest, ARegistrationWithoutAConnectionKeyTakesNoPlaceInARosterJob) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.num_workers = 1;
  options.start_timeout = absl::Seconds(1);
  Scheduler scheduler(options,
                      std::make_unique<RosterTransport>(net.NewTransport()));
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status result;
  std::thread scheduler_thread([&] { result = scheduler.Run(); });
  Options mine = options;
  mine.role = Role::kWorker;
  mine.port = 30020;
  mine.start_timeout = absl::Seconds(3);
  absl::StatusOr<std::unique_ptr<Node>> worker =
      Node::Start(mine, Node::Callbacks(), net.NewTransport());
  scheduler_thread.join();
  EXPECT_EQ(result.code(), absl::StatusCode::kDeadlineExceeded) << result;
  EXPECT_THAT(
      std::string(result.message()),
      ::testing::HasSubstr("1 of 1 worker(s) and 1 of 1 server(s) never "
                           "registered"));
  EXPECT_FALSE(worker.ok());
}

// An elastic job's workers past DMLC_NUM_WORKER that come before the job
// formed: at most MAX - DMLC_NUM_WORKER are held, and they join once it
// formed; the next is turned away, saying why; a held worker's sealed key is
// taken at once (another registration claiming it is ignored).
TEST(NodeTest, EarlyElasticWorkersAreHeldUpToMaxAndJoinOnceTheJobFormed) {
  MemoryNetwork net;
  Options options = EndOptions(Role::kScheduler);
  options.elastic_min = 1;
  options.elastic_max = 3;  // DMLC_NUM_WORKER 2: one may be held
  Scheduler scheduler(
      options, std::make_unique<KeyedTransport>(net.NewTransport(), 'S'));
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });
  auto start = [&](Role role, int port, char key, absl::Duration timeout) {
    Options mine = options;
    mine.role = role;
    mine.port = port;
    mine.start_timeout = timeout;
    return Node::Start(
        mine, Node::Callbacks(),
        std::make_unique<KeyedTransport>(net.NewTransport(), key));
  };
  absl::StatusOr<std::unique_ptr<Node>> a, b, c;
  std::thread ta(
      [&] { a = start(Role::kWorker, 30001, 'A', absl::Seconds(20)); });
  absl::SleepFor(absl::Milliseconds(300));
  std::thread tb(
      [&] { b = start(Role::kWorker, 30002, 'B', absl::Seconds(20)); });
  absl::SleepFor(absl::Milliseconds(300));
  std::thread tc(
      [&] { c = start(Role::kWorker, 30003, 'C', absl::Seconds(20)); });
  absl::SleepFor(absl::Milliseconds(500));
  // The job has its two workers and one held: the next is turned away.
  const absl::Time d_start = absl::Now();
  absl::StatusOr<std::unique_ptr<Node>> d =
      start(Role::kWorker, 30004, 'D', absl::Seconds(10));
  EXPECT_LT(absl::Now() - d_start, absl::Seconds(5)) << "told at once";
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(std::string(d.status().message()),
              ::testing::HasSubstr("the job will have its most workers, 3 "
                                   "(TESSERA_ELASTIC=1:3), once it formed"));
  // Claiming the held worker's key: ignored (not held, not turned away).
  absl::StatusOr<std::unique_ptr<Node>> e =
      start(Role::kWorker, 30005, 'C', absl::Seconds(1));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kDeadlineExceeded)
      << e.status();
  absl::StatusOr<std::unique_ptr<Node>> server =
      start(Role::kServer, 30000, 'V', absl::Seconds(20));
  ta.join();
  tb.join();
  tc.join();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(c.ok()) << c.status();
  // Ranks 0 and 1 go to the job's two workers, 2 to the held one (which of
  // them came third depends on the threads' timing).
  std::vector<int> ranks = {(*a)->rank(), (*b)->rank(), (*c)->rank()};
  std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(ranks, (std::vector<int>{0, 1, 2}));
  std::thread fa([&] { EXPECT_TRUE((*a)->Finish().ok()); });
  std::thread fb([&] { EXPECT_TRUE((*b)->Finish().ok()); });
  EXPECT_TRUE((*c)->Finish().ok());
  fa.join();
  fb.join();
  EXPECT_TRUE((*server)->WaitForTerminate().ok());
  scheduler_thread.join();
  EXPECT_TRUE(scheduler_result.ok()) << scheduler_result;
}

TEST(NodeTest,
     UnreachableAdvertisedAddressEndsTheJobAtTheStartDeadlineNamingIt) {
  MemoryNetwork net;
  Options sched_options = TestOptions(Role::kScheduler);
  sched_options.num_workers = 1;
  sched_options.start_timeout = absl::Seconds(1);
  Scheduler scheduler(sched_options, net.NewTransport());
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  const absl::Time start = absl::Now();
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });
  Options node_options = TestOptions(Role::kServer);
  node_options.num_workers = 1;
  node_options.start_timeout = absl::Seconds(1);
  absl::Status server_result, worker_result;
  std::thread server([&, server_options = node_options] {
    server_result =
        Node::Start(
            server_options, Node::Callbacks(),
            std::make_unique<MisadvertisingTransport>(net.NewTransport()))
            .status();
  });
  Options worker_options = node_options;
  worker_options.role = Role::kWorker;
  std::thread worker([&] {
    absl::StatusOr<std::unique_ptr<Node>> node =
        Node::Start(worker_options, Node::Callbacks(), net.NewTransport());
    worker_result = node.ok() ? (*node)->WaitForTerminate() : node.status();
  });
  scheduler_thread.join();
  server.join();
  worker.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(scheduler_result.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(scheduler_result.message()),
              ::testing::HasSubstr(
                  "cannot reach the address advertised by server 0 (id 8 at "
                  "127.0.0.1:"));
  // The reachable worker hears why; the unreachable server names its own
  // address.
  EXPECT_THAT(std::string(worker_result.message()),
              ::testing::HasSubstr("cannot reach the address"));
  EXPECT_THAT(std::string(server_result.message()),
              ::testing::HasSubstr("this node advertises 127.0.0.1:"));
}

// A replicated job (TESSERA_REPLICAS=2) of one worker and 2 servers on 3
// server ranks (TESSERA_MAX_SERVERS=3: rank 2 starts without a server).
Options TwoOfThreeServerRanks() {
  Options options = EndOptions(Role::kScheduler);
  options.num_workers = 1;
  options.num_servers = 3;
  options.initial_servers = 2;
  options.replicas = 2;
  return options;
}

using StartNode =
    std::function<absl::StatusOr<std::unique_ptr<Node>>(Role, int port)>;

// Starts such a job's servers (ports `port`, `port` + 1) and its worker
// (`port` + 2) with `start`, which the job waits for all together.
void StartTwoServersAndAWorker(const StartNode& start, int port,
                               absl::StatusOr<std::unique_ptr<Node>>* a,
                               absl::StatusOr<std::unique_ptr<Node>>* b,
                               absl::StatusOr<std::unique_ptr<Node>>* worker) {
  std::thread ta([&] { *a = start(Role::kServer, port); });
  std::thread tb([&] { *b = start(Role::kServer, port + 1); });
  *worker = start(Role::kWorker, port + 2);
  ta.join();
  tb.join();
}

TEST(NodeTest, AHandBackMissingAReportStartsAgainAndCompletes) {
  // A replicated job of 2 servers on 3 ranks (rank 2 without one) and a
  // spare that takes rank 2. Server A never reports its part of the first
  // hand-back attempt (a report lost for good); the scheduler starts the
  // hand-back again after options.handback_retry, and the second attempt,
  // which both report, restores rank 2.
  MemoryNetwork net;
  Options options = TwoOfThreeServerRanks();
  options.handback_retry = absl::Milliseconds(500);
  Scheduler scheduler(options, net.NewTransport());
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });

  // Notices are recorded on the receiving thread and answered from this one.
  absl::Mutex mu;
  std::vector<std::pair<int, uint64_t>> notices;  // (server 0 or 1, epoch)
  std::vector<int> notice_ranks;
  auto start = [&](Role role, int port, int server, bool spare) {
    Options mine = options;
    mine.role = role;
    mine.port = port;
    mine.spare = spare;
    Node::Callbacks callbacks;
    if (server >= 0) {
      callbacks.on_handback = [&, server](int rank, uint64_t epoch, bool) {
        absl::MutexLock lock(&mu);
        notices.emplace_back(server, epoch);
        notice_ranks.push_back(rank);
      };
    }
    return Node::Start(mine, std::move(callbacks), net.NewTransport());
  };
  absl::StatusOr<std::unique_ptr<Node>> a, b, worker;
  StartTwoServersAndAWorker(
      [&](Role role, int port) {
        return start(role, port, role == Role::kServer ? port - 31001 : -1,
                     false);
      },
      31001, &a, &b, &worker);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<std::unique_ptr<Node>> spare =
      start(Role::kServer, 31004, -1, true);
  ASSERT_TRUE(spare.ok()) << spare.status();
  EXPECT_EQ((*spare)->rank(), 2);
  EXPECT_TRUE((*spare)->catching_up());
  const absl::Time caught_up = absl::Now();
  (*spare)->ReportCaughtUp();

  Node* servers[2] = {a->get(), b->get()};
  size_t answered = 0;
  bool restored = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!restored && absl::Now() < deadline) {
    std::vector<std::pair<int, uint64_t>> fresh;
    {
      absl::MutexLock lock(&mu);
      fresh.assign(notices.begin() + answered, notices.end());
      answered = notices.size();
    }
    for (const auto& [server, epoch] : fresh) {
      if (server == 0 && epoch == 1) continue;  // "lost"
      servers[server]->ReportHandback(epoch);
    }
    restored = (*spare)->server_states()[2].restored;
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Duration took = absl::Now() - caught_up;
  ASSERT_TRUE(restored) << "rank 2 never restored";
  EXPECT_GE(took, options.handback_retry);
  {
    absl::MutexLock lock(&mu);
    // Both servers heard attempts 1 and 2 (a repeated notice is not
    // recorded twice: a node acknowledges it and calls back once per send,
    // so count distinct pairs), always about rank 2.
    std::set<std::pair<int, uint64_t>> distinct(notices.begin(), notices.end());
    EXPECT_TRUE(distinct.count({0, 1}) && distinct.count({0, 2}) &&
                distinct.count({1, 1}) && distinct.count({1, 2}));
    for (int rank : notice_ranks) EXPECT_EQ(rank, 2);
  }
  // Everyone hears it (the table change is resent until acknowledged).
  for (Node* n : {a->get(), b->get(), worker->get()}) {
    while (!n->server_states()[2].restored && absl::Now() < deadline)
      absl::SleepFor(absl::Milliseconds(20));
    EXPECT_TRUE(n->server_states()[2].restored) << n->Describe(n->id());
  }
  EXPECT_TRUE((*worker)->Finish().ok());
  std::thread ea([&] { EXPECT_TRUE((*a)->WaitForTerminate().ok()); });
  std::thread eb([&] { EXPECT_TRUE((*b)->WaitForTerminate().ok()); });
  EXPECT_TRUE((*spare)->WaitForTerminate().ok());
  ea.join();
  eb.join();
  scheduler_thread.join();
  EXPECT_TRUE(scheduler_result.ok()) << scheduler_result;
}

TEST(NodeTest, ANodeCountingOtherServerRanksThanTheJobStopsNamingTheVariables) {
  // A spare started without the job's TESSERA_MAX_SERVERS (2 ranks where the
  // job has 3) would place keys on the wrong servers: it stops at its table.
  MemoryNetwork net;
  const Options options = TwoOfThreeServerRanks();
  Scheduler scheduler(options, net.NewTransport());
  ASSERT_TRUE(scheduler.Bind().ok());
  absl::Status scheduler_result;
  std::thread scheduler_thread([&] { scheduler_result = scheduler.Run(); });
  auto start = [&](Role role, int port, int num_servers, bool spare) {
    Options mine = options;
    mine.role = role;
    mine.port = port;
    mine.num_servers = num_servers;
    mine.initial_servers = 0;
    mine.spare = spare;
    return Node::Start(mine, Node::Callbacks(), net.NewTransport());
  };
  absl::StatusOr<std::unique_ptr<Node>> a, b, worker;
  StartTwoServersAndAWorker(
      [&](Role role, int port) { return start(role, port, 3, false); }, 32001,
      &a, &b, &worker);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<std::unique_ptr<Node>> spare =
      start(Role::kServer, 32004, 2, true);
  ASSERT_FALSE(spare.ok());
  EXPECT_EQ(spare.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(spare.status().message(),
            "the job has 3 server rank(s) but this node was started with 2 "
            "(DMLC_NUM_SERVER, and TESSERA_MAX_SERVERS when set, must be the "
            "scheduler's on every node)");
  EXPECT_TRUE((*worker)->Finish().ok());
  std::thread ea([&] { EXPECT_TRUE((*a)->WaitForTerminate().ok()); });
  EXPECT_TRUE((*b)->WaitForTerminate().ok());
  ea.join();
  scheduler_thread.join();
  EXPECT_TRUE(scheduler_result.ok()) << scheduler_result;
}

}  // namespace
}  // namespace tessera
