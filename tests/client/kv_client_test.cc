// The KV client against real servers and a real scheduler, all in one process
// over the in-memory network (no processes, no sockets): MXNet's nightly
// values, lost replies resent and applied once, errors, and a restarted worker
// resuming at its round.
#include "worker/client/kv_client.h"

#include <atomic>
#include <cstring>
#include <map>
#include <functional>
#include <memory>
#include <optional>
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
// connections killed under them would; with `repeat_every`, also delivers
// every repeat_every-th one twice, as a resend answered twice would.
class LossyTransport : public Transport {
 public:
  LossyTransport(std::unique_ptr<Transport> inner, int every,
                 int repeat_every = 0)
      : inner_(std::move(inner)), every_(every), repeat_every_(repeat_every) {}
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
    if (again_.has_value()) {
      Message m = *std::move(again_);
      again_.reset();
      return m;
    }
    while (true) {
      absl::StatusOr<Message> msg = inner_->Receive(timeout);
      if (!msg.ok() || msg->header.plane() != wire::DATA ||
          msg->header.ack_only()) {
        return msg;
      }
      const int n = seen_++;
      if (n % every_ != 0) {
        if (repeat_every_ > 0 && n % repeat_every_ == 1) {
          again_ = *msg;
          ++repeated_;
        }
        return msg;
      }
      ++lost_;
    }
  }
  int repeated() const { return repeated_.load(); }
  uint64_t malformed_count() const override {
    return inner_->malformed_count();
  }
  void Close() override { inner_->Close(); }
  int lost() const { return lost_.load(); }

 private:
  std::unique_ptr<Transport> inner_;
  const int every_;
  const int repeat_every_;
  int seen_ = 0;  // Receive runs on one thread
  std::optional<Message> again_;
  std::atomic<int> lost_{0};
  std::atomic<int> repeated_{0};
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
  // Waits for the servers to end (after the job's end).
  void JoinServers() {
    for (std::thread& t : server_threads_) {
      if (t.joinable()) t.join();
    }
  }
  absl::Status JoinScheduler() {
    if (scheduler_thread_.joinable()) scheduler_thread_.join();
    return result_;
  }
  // Sums of every server's counters, once the servers have ended.
  uint64_t duplicates() {
    JoinServers();
    return duplicates_.load();
  }
  uint64_t pushes_applied() {
    JoinServers();
    return pushes_.load();
  }
  // Runs on each server's thread after the job ended, before it stops.
  void BeforeStop(std::function<void(KVServer&)> hook) {
    absl::MutexLock lock(&hook_mu_);
    before_stop_ = std::move(hook);
  }

 private:
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
    {
      absl::MutexLock lock(&hook_mu_);
      if (before_stop_) before_stop_(server);
    }
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
  absl::Mutex hook_mu_;
  std::function<void(KVServer&)> before_stop_ ABSL_GUARDED_BY(hook_mu_);
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
  std::vector<LossyTransport*> lossy(2);
  std::vector<std::vector<float>> last(2);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true,
      [&](KVClient& kv) { return Nightly(kv, 6, &last[kv.rank()]); },
      [&](int i) -> std::unique_ptr<Transport> {
        auto t = std::make_unique<LossyTransport>(net.NewTransport(), 4);
        lossy[i] = t.get();
        return t;
      });
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_GT(lossy[0]->lost() + lossy[1]->lost(), 10);
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

void RestartedWorkerResumes(bool compressed_pulls) {
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
    if (compressed_pulls) {
      if (absl::Status s = (*kv)->SetPullCompression("2bit"); !s.ok())
        return s;
    }
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
      if (compressed_pulls && life == 1 && static_cast<uint64_t>(r) == resumed[index]) {
        // A new life has no copy: its first pull brings the servers' whole.
        const KVWorkerStats st = (*kv)->stats();
        EXPECT_EQ(st.bytes_pulled, st.bytes_pulled_float32);
        EXPECT_EQ(st.bytes_pulled_float32, w.size() * sizeof(float));
      }
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
  // Each round adds 2 x (r + 1); nothing applied twice. (With compressed
  // pulls the workers hold the servers' shadow, which follows the weights
  // with 2-bit steps; both lives' copies agree with it and each other.)
  float want = 0;
  for (int r = 0; r < kRounds; ++r) want += 2.0f * (r + 1);
  ASSERT_EQ(final0.size(), 1500u);
  if (!compressed_pulls) {
    for (float v : final0) ASSERT_EQ(v, want);
  }
  EXPECT_EQ(final1, final0);
  EXPECT_EQ(cluster.pushes_applied(), 2u * kRounds * 2);
  EXPECT_TRUE(cluster.JoinScheduler().ok());
}

TEST(KVClientTest, RestartedWorkerResumesAtItsRound) {
  RestartedWorkerResumes(/*compressed_pulls=*/false);
}

TEST(KVClientTest, RestartedWorkerResynchronisesWithAWholePull) {
  RestartedWorkerResumes(/*compressed_pulls=*/true);
}

// Deterministic gradients: the same for a (rank, round, i) in every run.
float Gradient(int rank, int round, size_t i) {
  uint32_t x = static_cast<uint32_t>(rank * 7919 + round * 104729 + i * 31);
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  return (static_cast<float>(x % 2001) - 1000.0f) * 1e-3f;
}

// Compressed pulls in a job with lossy, repeating links: every worker's copy
// ends equal to the servers' shadows, bit for bit, for a key split over both
// servers and a small one.
void CompressedPullsMatchTheShadows(bool sync) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/3);
  InProcessCluster cluster(net, options);
  constexpr uint64_t kBig = 7, kSmall = 8;
  constexpr size_t kBigLen = 2500, kSmallLen = 30;  // kBig: 1250 per server
  constexpr int kRounds = 25;
  std::vector<std::vector<float>> big(3), small(3);
  std::vector<LossyTransport*> lossy(3);
  std::vector<uint64_t> pulled(3), pulled_float32(3);
  absl::Mutex mu;
  std::map<std::pair<uint64_t, uint64_t>, std::vector<float>> shadows;
  cluster.BeforeStop([&](KVServer& server) {
    for (auto [key, offset] : {std::pair<uint64_t, uint64_t>{kBig, 0},
                               {kBig, 1250},
                               {kSmall, 0}}) {
      auto [values, version] = server.ShadowForTesting(key, offset);
      if (values.empty()) continue;
      EXPECT_GT(version, 1u);
      absl::MutexLock lock(&mu);
      shadows[{key, offset}] = values;
    }
  });
  std::vector<absl::Status> results = RunWorkers(
      net, options, sync,
      [&](KVClient& kv) -> absl::Status {
        const int r = kv.rank();
        if (absl::Status s = kv.SetPullCompression("2bit"); !s.ok()) return s;
        if (absl::Status s =
                kv.SetOptimizer(sync ? "sgd lr=0.1 momentum=0.9" : "sgd lr=0.05");
            !s.ok()) {
          return s;
        }
        std::vector<float> b(kBigLen), m(kSmallLen);
        for (size_t i = 0; i < kBigLen; ++i) b[i] = Gradient(r, -1, i);
        for (size_t i = 0; i < kSmallLen; ++i) m[i] = Gradient(r, -2, i);
        if (absl::Status s = kv.Init(kBig, b); !s.ok()) return s;
        if (absl::Status s = kv.Init(kSmall, m); !s.ok()) return s;
        for (int round = 0; round < kRounds; ++round) {
          std::vector<float> gb(kBigLen), gm(kSmallLen);
          for (size_t i = 0; i < kBigLen; ++i) gb[i] = Gradient(r, round, i);
          for (size_t i = 0; i < kSmallLen; ++i) gm[i] = Gradient(r, round, i);
          if (absl::Status s = kv.Push(kBig, gb); !s.ok()) return s;
          if (absl::Status s = kv.Push(kSmall, gm); !s.ok()) return s;
          if (absl::Status s = kv.Pull(kBig, absl::MakeSpan(b)); !s.ok())
            return s;
          if (absl::Status s = kv.Pull(kSmall, absl::MakeSpan(m)); !s.ok())
            return s;
        }
        // Every push is in: two more pulls bring every copy to the last
        // version (the first may only catch up to the newest version there
        // was; the second is at the newest, or makes the last one).
        if (absl::Status s = kv.Barrier(); !s.ok()) return s;
        for (int again = 0; again < 2; ++again) {
          if (absl::Status s = kv.Pull(kBig, absl::MakeSpan(b)); !s.ok())
            return s;
          if (absl::Status s = kv.Pull(kSmall, absl::MakeSpan(m)); !s.ok())
            return s;
        }
        big[r] = b;
        small[r] = m;
        pulled[r] = kv.stats().bytes_pulled;
        pulled_float32[r] = kv.stats().bytes_pulled_float32;
        return absl::OkStatus();
      },
      [&](int i) -> std::unique_ptr<Transport> {
        auto t = std::make_unique<LossyTransport>(net.NewTransport(), 7, 5);
        lossy[i] = t.get();
        return t;
      });
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  cluster.JoinServers();  // the hook ran in their threads
  absl::MutexLock lock(&mu);
  ASSERT_EQ(shadows.size(), 3u);
  std::vector<float> want_big = shadows[{kBig, 0}];
  const std::vector<float>& upper = shadows[{kBig, 1250}];
  want_big.insert(want_big.end(), upper.begin(), upper.end());
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(big[r].size(), kBigLen);
    EXPECT_EQ(std::memcmp(big[r].data(), want_big.data(), kBigLen * 4), 0)
        << "rank " << r;
    EXPECT_EQ(std::memcmp(small[r].data(), shadows[{kSmall, 0}].data(),
                          kSmallLen * 4),
              0)
        << "rank " << r;
    // Every pull but the first of each slice was 2-bit: about 1/16.
    EXPECT_LT(pulled[r] * 8, pulled_float32[r]) << "rank " << r;
    EXPECT_GT(lossy[r]->lost(), 0) << "rank " << r;
    EXPECT_GT(lossy[r]->repeated(), 0) << "rank " << r;
  }
}

TEST(KVClientTest, CompressedPullCopiesEqualTheShadowsInDistSync) {
  CompressedPullsMatchTheShadows(/*sync=*/true);
}

TEST(KVClientTest, CompressedPullCopiesEqualTheShadowsInDistAsync) {
  CompressedPullsMatchTheShadows(/*sync=*/false);
}

}  // namespace
}  // namespace tessera
