// The KV client against real servers and a real scheduler, all in one process
// over the in-memory network (no processes, no sockets): MXNet's nightly
// values, lost replies resent and applied once, errors, and a restarted worker
// resuming at its round.
#include "worker/client/kv_client.h"

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/node.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "scheduler/scheduler.h"
#include "server/kv_server.h"
#include "tests/support/memory_network.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Loses every `every`-th data reply it receives (the first one included), as
// connections killed under them would, and counts them in `lost` (which the
// test keeps: the transport goes with its client).
class LossyTransport : public Transport {
 public:
  LossyTransport(std::unique_ptr<Transport> inner, int every,
                 std::shared_ptr<std::atomic<int>> lost)
      : inner_(std::move(inner)), every_(every), lost_(std::move(lost)) {}
  absl::StatusOr<int> Bind(const std::string& ip, int port) override {
    return inner_->Bind(ip, port);
  }
  absl::Status Connect(int peer, const std::string& ip, int port) override {
    return inner_->Connect(peer, ip, port);
  }
  void Disconnect(int peer) override { inner_->Disconnect(peer); }
  absl::Status Send(int peer, const Message& msg) override {
    return inner_->Send(peer, msg);
  }
  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    while (true) {
      absl::StatusOr<Message> msg = inner_->Receive(timeout);
      if (!msg.ok() || msg->header.plane() != wire::DATA ||
          msg->header.ack_only() || seen_++ % every_ != 0) {
        return msg;
      }
      ++*lost_;
    }
  }
  uint64_t malformed_count() const override {
    return inner_->malformed_count();
  }
  void Close() override { inner_->Close(); }

 private:
  std::unique_ptr<Transport> inner_;
  const int every_;
  int seen_ = 0;  // Receive runs on one thread at a time
  std::shared_ptr<std::atomic<int>> lost_;
};

// Which thread received each data-plane reply, and for which key.
class ReceivedLog {
 public:
  void Add(std::thread::id thread, uint64_t key) {
    absl::MutexLock lock(&mu_);
    received_.push_back({thread, key});
  }
  // Replies received on `thread` for `key`.
  int CountOn(std::thread::id thread, uint64_t key) const {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (const auto& [t, k] : received_) n += t == thread && k == key;
    return n;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::pair<std::thread::id, uint64_t>> received_
      ABSL_GUARDED_BY(mu_);
};

// Records in `log` (which the test keeps: the transport goes with its client)
// the thread and key of every data-plane message received.
class RecordingTransport : public Transport {
 public:
  RecordingTransport(std::unique_ptr<Transport> inner,
                     std::shared_ptr<ReceivedLog> log)
      : inner_(std::move(inner)), log_(std::move(log)) {}
  absl::StatusOr<int> Bind(const std::string& ip, int port) override {
    return inner_->Bind(ip, port);
  }
  absl::Status Connect(int peer, const std::string& ip, int port) override {
    return inner_->Connect(peer, ip, port);
  }
  void Disconnect(int peer) override { inner_->Disconnect(peer); }
  absl::Status Send(int peer, const Message& msg) override {
    return inner_->Send(peer, msg);
  }
  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    absl::StatusOr<Message> msg = inner_->Receive(timeout);
    if (msg.ok() && msg->header.plane() == wire::DATA)
      log_->Add(std::this_thread::get_id(), msg->header.slice().key());
    return msg;
  }
  uint64_t malformed_count() const override {
    return inner_->malformed_count();
  }
  void Close() override { inner_->Close(); }

 private:
  std::unique_ptr<Transport> inner_;
  std::shared_ptr<ReceivedLog> log_;
};

Options JobOptions(int servers, int workers) {
  Options o;
  o.root_uri = "127.0.0.1";
  o.root_port = 7100;
  o.num_servers = servers;
  o.num_workers = workers;
  o.heartbeat_interval = absl::Milliseconds(50);
  o.heartbeat_timeout = absl::Seconds(5);
  o.start_timeout = absl::Seconds(10);
  o.request_timeout = absl::Seconds(20);
  o.resend_timeout = absl::Milliseconds(50);
  o.bigarray_bound = 1000;  // keys of 1000 or more values are split
  return o;
}

// A scheduler and servers, each a Node with a KVServer, on `net`.
class InProcessCluster {
 public:
  InProcessCluster(MemoryNetwork& net, const Options& options)
      : net_(net), options_(options) {
    Options sched = options;
    sched.role = Role::kScheduler;
    scheduler_ = std::make_unique<Scheduler>(sched, net.NewTransport());
    EXPECT_TRUE(scheduler_->Bind().ok());
    scheduler_thread_ = std::thread([this] { result_ = scheduler_->Run(); });
    for (int i = 0; i < options.num_servers; ++i) {
      server_threads_.emplace_back([this] { RunServer(); });
    }
  }
  ~InProcessCluster() {
    JoinServers();
    if (scheduler_thread_.joinable()) scheduler_thread_.join();
  }
  absl::Status JoinScheduler() {
    if (scheduler_thread_.joinable()) scheduler_thread_.join();
    return result_;
  }
  // Sums of every server's counters, once every server has ended (a server
  // adds its counts after the scheduler has ended the job).
  uint64_t duplicates() {
    JoinServers();
    return duplicates_.load();
  }
  uint64_t pushes_applied() {
    JoinServers();
    return pushes_.load();
  }

 private:
  void JoinServers() {
    for (std::thread& t : server_threads_) {
      if (t.joinable()) t.join();
    }
  }
  void RunServer() {
    Options mine = options_;
    mine.role = Role::kServer;
    std::unique_ptr<Node> node;
    KVServer server(options_.num_workers, 2, [&node](int peer, Message m) {
      return node->Send(peer, std::move(m));
    });
    server.set_on_workers_finished([&node] { node->MarkPartDone(); });
    Node::Callbacks callbacks;
    callbacks.on_data = [&server](Message&& m) { server.Handle(std::move(m)); };
    absl::StatusOr<std::unique_ptr<Node>> started =
        Node::Start(mine, std::move(callbacks), net_.NewTransport());
    ASSERT_TRUE(started.ok()) << started.status();
    node = *std::move(started);
    node->StartDelivery();
    EXPECT_TRUE(node->WaitForTerminate().ok());
    node->Stop();
    server.Stop();
    duplicates_ += server.stats().duplicates();
    pushes_ += server.stats().pushes_applied();
  }

  MemoryNetwork& net_;
  const Options options_;
  std::unique_ptr<Scheduler> scheduler_;
  absl::Status result_;
  std::thread scheduler_thread_;
  std::vector<std::thread> server_threads_;
  std::atomic<uint64_t> duplicates_{0};
  std::atomic<uint64_t> pushes_{0};
};

// Runs `body` as each of `workers` clients, concurrently; returns their
// results.
std::vector<absl::Status> RunWorkers(
    MemoryNetwork& net, const Options& options, bool sync,
    const std::function<absl::Status(KVClient&)>& body,
    const std::function<std::unique_ptr<Transport>(int)>& transport =
        nullptr) {
  std::vector<absl::Status> results(options.num_workers);
  std::vector<std::thread> threads;
  for (int i = 0; i < options.num_workers; ++i) {
    threads.emplace_back([&, i] {
      Options mine = options;
      mine.role = Role::kWorker;
      absl::StatusOr<std::unique_ptr<KVClient>> kv = KVClient::Create(
          mine, sync, transport ? transport(i) : net.NewTransport());
      if (!kv.ok()) {
        results[i] = kv.status();
        return;
      }
      results[i] = body(**kv);
      absl::Status closed = (*kv)->Close();
      if (results[i].ok()) results[i] = closed;
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// MXNet's nightly check: keys initialised to ones, w += 2g, each rank pushes
// rank + 1 and pulls; after round i every value is 1 + n(n+1)(i+1).
absl::Status Nightly(KVClient& kv, int rounds, std::vector<float>* last) {
  const int n = kv.num_workers();
  const uint64_t kSmall = 3, kBig = 5;
  std::vector<float> small(6, 1.0f), big(2000, 1.0f);  // big is split
  if (absl::Status s = kv.SetOptimizer("sgd lr=-2"); !s.ok()) return s;
  if (absl::Status s = kv.Init(kSmall, small); !s.ok()) return s;
  if (absl::Status s = kv.Init(kBig, big); !s.ok()) return s;
  for (int i = 0; i < rounds; ++i) {
    std::vector<float> g_small(small.size(), kv.rank() + 1.0f);
    std::vector<float> g_big(big.size(), kv.rank() + 1.0f);
    if (absl::Status s = kv.Push(kSmall, g_small); !s.ok()) return s;
    if (absl::Status s = kv.Push(kBig, g_big); !s.ok()) return s;
    if (absl::Status s = kv.Pull(kSmall, absl::MakeSpan(small)); !s.ok())
      return s;
    if (absl::Status s = kv.Pull(kBig, absl::MakeSpan(big)); !s.ok()) return s;
    const float want = 1.0f + n * (n + 1) * (i + 1.0f);
    for (float v : small)
      if (v != want) return absl::InternalError(absl::StrCat("small ", v, " != ", want));
    for (float v : big)
      if (v != want) return absl::InternalError(absl::StrCat("big ", v, " != ", want));
  }
  *last = big;
  return absl::OkStatus();
}

TEST(KVClientTest, NightlyValuesWithASplitKeyOverTheMemoryNetwork) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/3);
  InProcessCluster cluster(net, options);
  std::vector<std::vector<float>> last(3);
  std::vector<absl::Status> results =
      RunWorkers(net, options, /*sync=*/true, [&](KVClient& kv) {
        return Nightly(kv, 5, &last[kv.rank()]);
      });
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_EQ(last[0], last[2]);
  EXPECT_EQ(cluster.pushes_applied(), 3u * 5 * (1 + 2))
      << "3 workers x 5 rounds x (small key + two parts of the big one)";
}

TEST(KVClientTest, LostRepliesAreResentAndAppliedOnce) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/2);
  InProcessCluster cluster(net, options);
  auto lost = std::make_shared<std::atomic<int>>(0);
  std::vector<std::vector<float>> last(2);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true,
      [&](KVClient& kv) { return Nightly(kv, 6, &last[kv.rank()]); },
      [&](int i) -> std::unique_ptr<Transport> {
        return std::make_unique<LossyTransport>(net.NewTransport(), 4, lost);
      });
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_GT(lost->load(), 10);
  EXPECT_GT(cluster.duplicates(), 0u);
  // Every push applied exactly once despite the resends.
  EXPECT_EQ(cluster.pushes_applied(), 2u * 6 * (1 + 2));
}

TEST(KVClientTest, ErrorsReachTheCallerAndTheClusterKeepsServing) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/1, /*workers=*/1);
  InProcessCluster cluster(net, options);
  std::vector<absl::Status> results =
      RunWorkers(net, options, /*sync=*/false, [&](KVClient& kv) {
        std::vector<float> v(4, 1.0f);
        absl::Status s = kv.Pull(1, absl::MakeSpan(v));
        EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
        EXPECT_THAT(std::string(s.message()), HasSubstr("never initialised"));
        EXPECT_TRUE(kv.Init(1, v).ok());
        s = kv.Push(1, std::vector<float>(3, 1.0f));
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        // dist_async without an optimizer: the server's error, then it serves.
        s = kv.Push(1, v);
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_THAT(std::string(s.message()), HasSubstr("needs an optimizer"));
        s = kv.SetOptimizer("sgd lr=0.1");
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
        std::vector<float> out(4, 0.0f);
        EXPECT_TRUE(kv.Pull(1, absl::MakeSpan(out)).ok());
        EXPECT_EQ(out, v);
        return absl::OkStatus();
      });
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(cluster.JoinScheduler().ok());
}

// Issue #12: a thread in Wait takes its replies off the transport itself, and
// dispatches the replies of other operations that come first.
TEST(KVClientTest, WaitingThreadReceivesItsRepliesAndThoseOfOtherOperations) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/1, /*workers=*/1);
  InProcessCluster cluster(net, options);
  auto received = std::make_shared<ReceivedLog>();
  std::thread::id caller;
  constexpr int kRounds = 40;
  const uint64_t kMine = 1, kOther = 2;
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true,
      [&](KVClient& kv) -> absl::Status {
        caller = std::this_thread::get_id();
        std::vector<float> mine(8, 0.0f), other(8, 0.0f);
        if (absl::Status s = kv.SetOptimizer("sgd lr=-1"); !s.ok()) return s;
        if (absl::Status s = kv.Init(kMine, mine); !s.ok()) return s;
        if (absl::Status s = kv.Init(kOther, other); !s.ok()) return s;
        const std::vector<float> one(8, 1.0f);
        for (int r = 0; r < kRounds; ++r) {
          // The other key's pull is answered before this thread waits for
          // the pushpull, whose wait receives and dispatches it.
          absl::StatusOr<OpHandle> pull =
              kv.PullAsync(kOther, absl::MakeSpan(other));
          if (!pull.ok()) return pull.status();
          if (absl::Status s = kv.PushPull(kMine, one, absl::MakeSpan(mine));
              !s.ok()) {
            return s;
          }
          if (absl::Status s = kv.Wait(*pull); !s.ok()) return s;
          for (float v : mine) {
            if (v != r + 1.0f) {
              return absl::InternalError(
                  absl::StrCat("round ", r, ": ", v, " != ", r + 1));
            }
          }
          if (other != std::vector<float>(8, 0.0f))
            return absl::InternalError("the other key changed");
        }
        return absl::OkStatus();
      },
      [&](int) -> std::unique_ptr<Transport> {
        return std::make_unique<RecordingTransport>(net.NewTransport(),
                                                    received);
      });
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_EQ(cluster.pushes_applied(), static_cast<uint64_t>(kRounds));
  // Timing decides a few (the node's receiver thread takes the transport back
  // when no caller received for Node::kCallerGrace); most replies of this
  // tight loop are received by the calling thread, the other key's included.
  const int mine_here = received->CountOn(caller, kMine);
  const int other_here = received->CountOn(caller, kOther);
  EXPECT_GE(mine_here, kRounds / 4) << "pushpull replies on the caller";
  EXPECT_GE(other_here, kRounds / 4) << "pull replies on the caller";
}

// Several threads of one worker wait at once while every fourth reply is
// lost: one of them receives for all, the others' replies and the replies to
// resent requests included; every push is applied once.
TEST(KVClientTest, ConcurrentWaitersGetTheirRepliesAndResendsWhileOneReceives) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/1);
  InProcessCluster cluster(net, options);
  constexpr int kThreads = 3, kRounds = 30;
  auto lost = std::make_shared<std::atomic<int>>(0);
  std::vector<absl::Status> thread_results(kThreads);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true,
      [&](KVClient& kv) -> absl::Status {
        if (absl::Status s = kv.SetOptimizer("sgd lr=-1"); !s.ok()) return s;
        // Key t + 1, of 1500 values: split over both servers.
        for (int t = 0; t < kThreads; ++t) {
          if (absl::Status s = kv.Init(t + 1, std::vector<float>(1500, 0.0f));
              !s.ok()) {
            return s;
          }
        }
        std::vector<std::thread> threads;
        for (int t = 0; t < kThreads; ++t) {
          threads.emplace_back([&, t] {
            const uint64_t key = t + 1;
            std::vector<float> w(1500, 0.0f);
            const std::vector<float> g(1500, static_cast<float>(key));
            for (int r = 0; r < kRounds; ++r) {
              absl::Status s = kv.PushPull(key, g, absl::MakeSpan(w));
              if (s.ok() && w[0] != key * (r + 1.0f)) {
                s = absl::InternalError(absl::StrCat(
                    "key ", key, " round ", r, ": ", w[0], " != ",
                    key * (r + 1.0f)));
              }
              if (!s.ok()) {
                thread_results[t] = s;
                return;
              }
            }
          });
        }
        for (std::thread& t : threads) t.join();
        return absl::OkStatus();
      },
      [&](int) -> std::unique_ptr<Transport> {
        return std::make_unique<LossyTransport>(net.NewTransport(), 4, lost);
      });
  EXPECT_TRUE(results[0].ok()) << results[0];
  for (const absl::Status& s : thread_results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_GT(lost->load(), 10);
  EXPECT_GT(cluster.duplicates(), 0u);
  EXPECT_EQ(cluster.pushes_applied(),
            static_cast<uint64_t>(kThreads) * kRounds * 2)
      << "every push of both parts applied exactly once";
}

TEST(KVClientTest, RestartedWorkerResumesAtItsRound) {
  MemoryNetwork net;
  Options options = JobOptions(/*servers=*/2, /*workers=*/2);
  options.heartbeat_timeout = absl::Seconds(10);  // the restart comes sooner
  InProcessCluster cluster(net, options);
  constexpr int kRounds = 8, kDieAfter = 3;
  const uint64_t kKey = 11;
  std::vector<absl::Status> results(2);
  std::vector<float> final0, final1;
  std::vector<uint64_t> resumed(2, 999);
  auto worker = [&](int index, uint64_t life, int from, int to,
                    std::vector<float>* out) -> absl::Status {
    Options mine = options;
    mine.role = Role::kWorker;
    mine.port = 21000 + index;  // fixed: a restart comes back at its address
    mine.restart_count = life;
    absl::StatusOr<std::unique_ptr<KVClient>> kv =
        KVClient::Create(mine, /*sync=*/true, net.NewTransport());
    if (!kv.ok()) return kv.status();
    std::vector<float> w(1500, 0.0f);  // split over both servers
    if (life == 0) {
      if (absl::Status s = (*kv)->SetOptimizer("sgd lr=-1"); !s.ok()) return s;
    }
    if (absl::Status s = (*kv)->Init(kKey, w); !s.ok()) return s;
    resumed[index] = (*kv)->ResumeRound();
    for (int r = std::max<int>(from, resumed[index]); r < to; ++r) {
      std::vector<float> g(w.size(), static_cast<float>(r + 1));
      if (absl::Status s = (*kv)->Push(kKey, g); !s.ok()) return s;
      if (absl::Status s = (*kv)->Pull(kKey, absl::MakeSpan(w)); !s.ok())
        return s;
    }
    *out = w;
    if (to < kRounds) return absl::OkStatus();  // dies without closing
    return (*kv)->Close();
  };
  std::thread first([&] { results[0] = worker(0, 0, 0, kRounds, &final0); });
  std::thread second([&] {
    std::vector<float> ignored;
    absl::Status died = worker(1, 0, 0, kDieAfter, &ignored);
    EXPECT_TRUE(died.ok()) << died;
    results[1] = worker(1, 1, 0, kRounds, &final1);
  });
  first.join();
  second.join();
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(results[1].ok()) << results[1];
  EXPECT_EQ(resumed[1], static_cast<uint64_t>(kDieAfter));
  // Each round adds 2 x (r + 1); nothing applied twice.
  float want = 0;
  for (int r = 0; r < kRounds; ++r) want += 2.0f * (r + 1);
  ASSERT_EQ(final0.size(), 1500u);
  for (float v : final0) ASSERT_EQ(v, want);
  EXPECT_EQ(final1, final0);
  EXPECT_EQ(cluster.pushes_applied(), 2u * kRounds * 2);
  EXPECT_TRUE(cluster.JoinScheduler().ok());
}

}  // namespace
}  // namespace tessera
