// The KV client against real servers and a real scheduler, all in one process
// over the in-memory network (no processes, no sockets): MXNet's nightly
// values, lost replies resent and applied once, errors, and a restarted worker
// resuming at its round.
#include "worker/client/kv_client.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/compression/two_bit.h"
#include "common/hashed_spec.h"
#include "common/node.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "scheduler/scheduler.h"
#include "server/kv_server.h"
#include "tests/support/forwarding_transport.h"
#include "tests/support/memory_network.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Loses every `every`-th data reply it receives (the first one included), as
// connections killed under them would, and counts them in `lost`; with
// `repeat_every`, also delivers every repeat_every-th one twice, as a resend
// answered twice would, counting them in `repeated`. The counters are shared
// so that a test can keep them: the transport is destroyed with its client.
class LossyTransport : public Transport {
 public:
  LossyTransport(std::unique_ptr<Transport> inner, int every,
                 int repeat_every = 0,
                 std::shared_ptr<std::atomic<int>> lost =
                     std::make_shared<std::atomic<int>>(0),
                 std::shared_ptr<std::atomic<int>> repeated =
                     std::make_shared<std::atomic<int>>(0))
      : inner_(std::move(inner)),
        every_(every),
        repeat_every_(repeat_every),
        lost_(std::move(lost)),
        repeated_(std::move(repeated)) {}
  LossyTransport(std::unique_ptr<Transport> inner, int every,
                 std::shared_ptr<std::atomic<int>> lost)
      : LossyTransport(std::move(inner), every, 0, std::move(lost)) {}
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
          ++*repeated_;
        }
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
  const int repeat_every_;
  int seen_ = 0;  // Receive runs on one thread at a time
  std::optional<Message> again_;
  std::shared_ptr<std::atomic<int>> lost_;
  std::shared_ptr<std::atomic<int>> repeated_;
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
    const std::function<std::unique_ptr<Transport>(int)>& transport = nullptr) {
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
      if (v != want)
        return absl::InternalError(absl::StrCat("small ", v, " != ", want));
    for (float v : big)
      if (v != want)
        return absl::InternalError(absl::StrCat("big ", v, " != ", want));
  }
  *last = big;
  return absl::OkStatus();
}

TEST(KVClientTest, NightlyValuesWithASplitKeyOverTheMemoryNetwork) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/3);
  InProcessCluster cluster(net, options);
  std::vector<std::vector<float>> last(3);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true,
      [&](KVClient& kv) { return Nightly(kv, 5, &last[kv.rank()]); });
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_EQ(last[0], last[2]);
  EXPECT_EQ(cluster.pushes_applied(), 3u * 5 * (1 + 2))
      << "3 workers x 5 rounds x (small key + two parts of the big one)";
}

// Issue #12: PullView lends the replies' frames. Values as the nightly check's;
// a view taken after round i keeps round i's values after later rounds (the
// server answered with its weights, and copies them on write); the split key
// arrives in its two parts; errors name the key.
TEST(KVClientTest, PullViewLendsTheRepliedFramesAndTheyKeepTheirRound) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/2);
  InProcessCluster cluster(net, options);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
        const int n = kv.num_workers();
        const uint64_t kSmall = 3, kBig = 5, kRowKey = 9;
        if (absl::Status s = kv.SetOptimizer("sgd lr=-2"); !s.ok()) return s;
        if (absl::Status s = kv.Init(kSmall, std::vector<float>(6, 1.0f));
            !s.ok())
          return s;
        if (absl::Status s = kv.Init(kBig, std::vector<float>(2000, 1.0f));
            !s.ok())
          return s;
        if (absl::Status s = kv.InitRows(kRowKey, nullptr, 10, 2); !s.ok())
          return s;
        std::vector<PulledValue> small_views, big_views;
        for (int i = 0; i < 4; ++i) {
          if (absl::Status s =
                  kv.Push(kSmall, std::vector<float>(6, kv.rank() + 1.0f));
              !s.ok())
            return s;
          if (absl::Status s =
                  kv.Push(kBig, std::vector<float>(2000, kv.rank() + 1.0f));
              !s.ok())
            return s;
          absl::StatusOr<PulledValue> small = kv.PullView(kSmall);
          if (!small.ok()) return small.status();
          PulledValue big;
          absl::StatusOr<OpHandle> h = kv.PullViewAsync(kBig, &big);
          if (!h.ok()) return h.status();
          if (absl::Status s = kv.Wait(*h); !s.ok()) return s;
          small_views.push_back(*small);
          big_views.push_back(big);
        }
        for (int i = 0; i < 4; ++i) {
          const float want = 1.0f + n * (n + 1) * (i + 1.0f);
          const PulledValue& small = small_views[i];
          const PulledValue& big = big_views[i];
          EXPECT_EQ(small.size(), 6u);
          EXPECT_EQ(small.num_parts(), 1u);
          EXPECT_THAT(
              std::vector<float>(small.span().begin(), small.span().end()),
              ::testing::Each(want))
              << "round " << i;
          EXPECT_EQ(big.size(), 2000u);
          EXPECT_EQ(big.num_parts(), 2u) << "split over both servers";
          EXPECT_TRUE(big.span().empty());
          EXPECT_EQ(big.offset(0), 0u);
          EXPECT_EQ(big.offset(1), 1000u);
          EXPECT_EQ(big.part(0).size() + big.part(1).size(), 2000u);
          std::vector<float> whole(2000, 0.0f);
          EXPECT_TRUE(big.CopyTo(absl::MakeSpan(whole)).ok());
          EXPECT_THAT(whole, ::testing::Each(want)) << "round " << i;
        }
        std::vector<float> three(3);
        absl::Status s = small_views[0].CopyTo(absl::MakeSpan(three));
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(s.message()), HasSubstr("6 values into 3"));
        s = kv.PullView(77).status();
        EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
        EXPECT_THAT(std::string(s.message()), HasSubstr("pull_view of key 77"));
        s = kv.PullView(kRowKey).status();
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(s.message()), HasSubstr("row-sparse"));
        s = kv.PullViewAsync(kSmall, nullptr).status();
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(PulledValue().size(), 0u);
        EXPECT_TRUE(PulledValue().span().empty());
        return absl::OkStatus();
      });
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
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

// A push a server refuses (too much of this worker already waits on the key)
// was never taken, so the server's count of the worker's pushes stays behind:
// the worker's later pushes and pulls of that key fail at once naming the
// refused push, instead of waiting for it until TESSERA_TIMEOUT (20 s here).
// The pushes that were taken or held still complete and the job ends.
TEST(KVClientTest, AfterARefusedPushTheKeyFailsAtOnceNamingIt) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/1, /*workers=*/2);
  InProcessCluster cluster(net, options);
  constexpr int kIssued = 70;
  constexpr int kTaken = 65;  // push 0 in the open round, 1..64 held (limit)
  absl::Notification refused;
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
        TESSERA_RETURN_IF_ERROR(kv.Init(7, std::vector<float>(4, 0.0f)));
        const std::vector<float> g(4, 1.0f);
        if (kv.rank() == 1) {
          refused.WaitForNotification();
          for (int i = 0; i < kTaken; ++i)
            TESSERA_RETURN_IF_ERROR(kv.Push(7, g));
          return absl::OkStatus();
        }
        std::vector<OpHandle> ops;
        for (int i = 0; i < kIssued; ++i) {
          absl::StatusOr<OpHandle> op = kv.PushAsync(7, g);
          if (!op.ok()) return op.status();
          ops.push_back(*op);
        }
        for (int i = kTaken; i < kIssued; ++i) {
          const absl::Status s = kv.Wait(ops[i]);
          EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted)
              << "push " << i << ": " << s;
        }
        const absl::Time start = absl::Now();
        std::vector<float> out(4);
        const absl::Status pulled = kv.Pull(7, absl::MakeSpan(out));
        const absl::Status pushed = kv.Push(7, g);
        EXPECT_LT(absl::Now() - start, absl::Seconds(5));
        for (const absl::Status& s : {pulled, pushed}) {
          EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
          EXPECT_THAT(std::string(s.message()),
                      HasSubstr("key 7: push 65 of this worker was refused "
                                "(key 7: node "));
          EXPECT_THAT(std::string(s.message()),
                      HasSubstr("its later pushes and pulls of the key would "
                                "wait for it for ever"));
        }
        refused.Notify();
        for (int i = 0; i < kTaken; ++i)
          TESSERA_RETURN_IF_ERROR(kv.Wait(ops[i]));
        return absl::OkStatus();
      });
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_EQ(cluster.pushes_applied(), 2u * kTaken);
}

// Spoils every copy of push 0 of the keys it has a spoiler for, as a buggy
// or hostile sender would, on its way to the servers.
class SpoilingTap : public ForwardingTransport {
 public:
  using Spoiler = std::function<void(Message*)>;
  SpoilingTap(std::unique_ptr<Transport> inner,
              std::map<uint64_t, Spoiler> spoilers)
      : ForwardingTransport(std::move(inner)), spoilers_(std::move(spoilers)) {}
  absl::Status Send(int peer, const Message& msg) override {
    const wire::Header& h = msg.header;
    auto it = spoilers_.find(h.slice().key());
    if (h.plane() != wire::DATA || h.command() != wire::KV_PUSH ||
        h.push_seq() != 0 || h.probe() || it == spoilers_.end()) {
      return ForwardingTransport::Send(peer, msg);
    }
    Message spoiled = msg;
    it->second(&spoiled);
    return ForwardingTransport::Send(peer, spoiled);
  }

 private:
  const std::map<uint64_t, Spoiler> spoilers_;
};

// A push its server refused before taking its number leaves this worker's
// count of the key's pushes one ahead of the server's: the key's later
// pushes and pulls fail at once, naming the refused push and the server's
// reason, instead of waiting for it until the request timeout. Key 7's push
// 0 claims a value too many (refused before the number was taken before the
// fix too; the next push waited for it); key 8's 2-bit codes do not decode
// (refused after the number was taken before the fix).
TEST(KVClientTest, APushRefusedBeforeItsNumberWasTakenFailsItsKeyAtOnce) {
  MemoryNetwork net;
  Options options = JobOptions(/*servers=*/1, /*workers=*/1);
  options.request_timeout = absl::Seconds(5);
  InProcessCluster cluster(net, options);
  std::map<uint64_t, SpoilingTap::Spoiler> spoilers = {
      {7, [](Message* m) { m->header.mutable_frames(0)->set_num_values(5); }},
      {8, [](Message* m) {
         // Element 0's code becomes 0b01, which no encoder emits.
         m->data[0] = Buffer::CopyOf("\x40\0\0\0", 4);
       }}};
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true,
      [&](KVClient& kv) -> absl::Status {
        TESSERA_RETURN_IF_ERROR(kv.SetGradientCompression("2bit", 0.5f));
        const std::vector<float> g = {0.6f, -0.7f, 0.6f, 0.0f};
        const std::map<uint64_t, std::pair<absl::StatusCode, std::string>>
            want = {
                {7,
                 {absl::StatusCode::kInvalidArgument,
                  "push of key 7 has 5 values; the key has 4 here"}},
                {8,
                 {absl::StatusCode::kDataLoss,
                  "push of key 8: 2-bit payload holds the invalid code 0b01 "
                  "at slot 0"}}};
        for (const auto& [key, refusal] : want) {
          TESSERA_RETURN_IF_ERROR(kv.Init(key, std::vector<float>(4, 1.0f)));
          absl::Status s = kv.Push(key, g);
          EXPECT_EQ(s.code(), refusal.first) << s;
          EXPECT_EQ(s.message(), refusal.second);
          const absl::Time start = absl::Now();
          std::vector<float> out(4);
          const absl::Status pushed = kv.Push(key, g);
          const absl::Status pulled = kv.Pull(key, absl::MakeSpan(out));
          EXPECT_LT(absl::Now() - start, absl::Seconds(1))
              << "key " << key << " waited";
          for (const absl::Status& later : {pushed, pulled}) {
            EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition)
                << later;
            EXPECT_EQ(later.message(),
                      absl::StrCat("key ", key,
                                   ": push 0 of this worker was refused (",
                                   refusal.second,
                                   "); its later pushes and pulls of the key "
                                   "would wait for it for ever"));
          }
        }
        return absl::OkStatus();
      },
      [&](int) {
        return std::make_unique<SpoilingTap>(net.NewTransport(), spoilers);
      });
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_EQ(cluster.pushes_applied(), 0u);
}

// A push refused after its server took its number (dist_async without an
// optimizer on the servers) counts: the key stays in step, so its next push
// is answered by the server (the same refusal, not the key's) and its pull
// is answered with the value.
TEST(KVClientTest, APushRefusedAfterItsNumberWasTakenLeavesItsKeyInStep) {
  MemoryNetwork net;
  Options options = JobOptions(/*servers=*/1, /*workers=*/1);
  options.request_timeout = absl::Seconds(5);
  InProcessCluster cluster(net, options);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/false, [&](KVClient& kv) -> absl::Status {
        const std::vector<float> v = {1.0f, 2.0f, 3.0f, 4.0f};
        TESSERA_RETURN_IF_ERROR(kv.Init(3, v));
        const absl::Time start = absl::Now();
        for (int i = 0; i < 2; ++i) {
          const absl::Status s = kv.Push(3, v);
          EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
          EXPECT_EQ(s.message(),
                    "dist_async needs an optimizer on the servers: call "
                    "set_optimizer before pushing")
              << "push " << i;
        }
        std::vector<float> out(4, 0.0f);
        TESSERA_RETURN_IF_ERROR(kv.Pull(3, absl::MakeSpan(out)));
        EXPECT_EQ(out, v);
        EXPECT_LT(absl::Now() - start, absl::Seconds(4));
        return absl::OkStatus();
      });
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_EQ(cluster.pushes_applied(), 0u);
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
                s = absl::InternalError(absl::StrCat("key ", key, " round ", r,
                                                     ": ", w[0],
                                                     " != ", key * (r + 1.0f)));
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
      if (absl::Status s = (*kv)->SetPullCompression("2bit"); !s.ok()) return s;
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
      if (compressed_pulls && life == 1 &&
          static_cast<uint64_t>(r) == resumed[index]) {
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
  // Kept here: each LossyTransport is destroyed with its client.
  std::vector<std::shared_ptr<std::atomic<int>>> lost(3), repeated(3);
  for (int i = 0; i < 3; ++i) {
    lost[i] = std::make_shared<std::atomic<int>>(0);
    repeated[i] = std::make_shared<std::atomic<int>>(0);
  }
  std::vector<uint64_t> pulled(3), pulled_float32(3);
  absl::Mutex mu;
  std::map<std::pair<uint64_t, uint64_t>, std::vector<float>> shadows;
  cluster.BeforeStop([&](KVServer& server) {
    for (auto [key, offset] :
         {std::pair<uint64_t, uint64_t>{kBig, 0}, {kBig, 1250}, {kSmall, 0}}) {
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
        if (absl::Status s = kv.SetOptimizer(sync ? "sgd lr=0.1 momentum=0.9"
                                                  : "sgd lr=0.05");
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
        // The last pull of the big key is a view (the copy copied out).
        for (int again = 0; again < 2; ++again) {
          if (again == 1) {
            absl::StatusOr<PulledValue> view = kv.PullView(kBig);
            if (!view.ok()) return view.status();
            if (view->num_parts() != 2)
              return absl::InternalError("the view should have two parts");
            if (absl::Status s = view->CopyTo(absl::MakeSpan(b)); !s.ok())
              return s;
          } else if (absl::Status s = kv.Pull(kBig, absl::MakeSpan(b));
                     !s.ok()) {
            return s;
          }
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
        return std::make_unique<LossyTransport>(net.NewTransport(), 7, 5,
                                                lost[i], repeated[i]);
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
    EXPECT_GT(lost[r]->load(), 0) << "rank " << r;
    EXPECT_GT(repeated[r]->load(), 0) << "rank " << r;
  }
}

TEST(KVClientTest, CompressedPullCopiesEqualTheShadowsInDistSync) {
  CompressedPullsMatchTheShadows(/*sync=*/true);
}

TEST(KVClientTest, CompressedPullCopiesEqualTheShadowsInDistAsync) {
  CompressedPullsMatchTheShadows(/*sync=*/false);
}

// --- Row-sparse keys -------------------------------------------------------

// 300 rows of 4 (1200 values, at the bound of 1000): split by rows over both
// servers, rows [0, 150) and [150, 300).
constexpr uint64_t kRowKey = 40, kRows = 300, kRowLen = 4;

std::vector<float> RowValues(const std::vector<float>& per_row) {
  std::vector<float> out;
  for (float v : per_row) out.insert(out.end(), kRowLen, v);
  return out;
}

// Every row's first value (all four are equal in these tests).
std::vector<float> FirstOfRows(const std::vector<float>& rows) {
  std::vector<float> out;
  for (size_t i = 0; i < rows.size(); i += kRowLen) out.push_back(rows[i]);
  return out;
}

TEST(KVClientTest, RowSparseSyncRoundsSumRowsByIdAndKeepTheOthers) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/3);
  InProcessCluster cluster(net, options);
  const std::vector<uint64_t> ask = {0, 1, 2, 3, 150, 151, 152, 200, 299, 0};
  std::vector<std::vector<float>> got(3), unchanged(3), empty_pull(3);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
        const int r = kv.rank();
        TESSERA_RETURN_IF_ERROR(kv.SetOptimizer("sgd lr=-1"));  // w += sum
        std::vector<float> ones(kRows * kRowLen, 1.0f);
        TESSERA_RETURN_IF_ERROR(
            kv.InitRows(kRowKey, ones.data(), kRows, kRowLen));
        // Rank r writes r + 1 into rows r, r+1, 150+r and 200; rank 0 names
        // row 0 twice (summed).
        std::vector<uint64_t> ids = {static_cast<uint64_t>(r),
                                     static_cast<uint64_t>(r + 1),
                                     static_cast<uint64_t>(150 + r), 200};
        if (r == 0) ids.push_back(0);
        TESSERA_RETURN_IF_ERROR(kv.PushRows(
            kRowKey, ids, RowValues(std::vector<float>(ids.size(), r + 1.0f))));
        std::vector<float> out(ask.size() * kRowLen);
        TESSERA_RETURN_IF_ERROR(kv.PullRows(kRowKey, ask, absl::MakeSpan(out)));
        got[r] = FirstOfRows(out);
        // A round in which nobody pushes a row changes nothing.
        TESSERA_RETURN_IF_ERROR(kv.PushRows(kRowKey, {}, {}));
        TESSERA_RETURN_IF_ERROR(kv.PullRows(kRowKey, ask, absl::MakeSpan(out)));
        unchanged[r] = FirstOfRows(out);
        std::vector<float> none;
        TESSERA_RETURN_IF_ERROR(kv.PullRows(kRowKey, {}, absl::MakeSpan(none)));
        empty_pull[r] = none;
        return absl::OkStatus();
      });
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  // 1 + the sum over the rows' writers.
  const std::vector<float> want = {
      1 + 1 + 1, 1 + 1 + 2, 1 + 2 + 3,     1 + 3, 1 + 1,
      1 + 2,     1 + 3,     1 + 1 + 2 + 3, 1,     1 + 1 + 1};
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(got[r], want) << "rank " << r;
    EXPECT_EQ(unchanged[r], want) << "rank " << r;
    EXPECT_TRUE(empty_pull[r].empty());
  }
}

TEST(KVClientTest, RowSparseLazyUpdatesLeaveAbsentRowsAndTheirStateAlone) {
  for (const char* spec : {"sgd lr=0.1 momentum=0.9", "adam lr=0.01"}) {
    SCOPED_TRACE(spec);
    MemoryNetwork net;
    const Options options = JobOptions(/*servers=*/1, /*workers=*/2);
    InProcessCluster cluster(net, options);
    std::vector<float> row0_after_1, row0_after_2, row0_after_3;
    std::vector<absl::Status> results = RunWorkers(
        net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
          TESSERA_RETURN_IF_ERROR(kv.SetOptimizer(spec));
          TESSERA_RETURN_IF_ERROR(kv.InitRows(kRowKey, nullptr, 10, kRowLen));
          const std::vector<float> g = RowValues({0.5f});
          std::vector<float> row(kRowLen);
          // Round 1: row 0 has a gradient; rounds 2 and 3 only row 1 has.
          TESSERA_RETURN_IF_ERROR(kv.PushRows(kRowKey, {0}, g));
          TESSERA_RETURN_IF_ERROR(
              kv.PullRows(kRowKey, {0}, absl::MakeSpan(row)));
          if (kv.rank() == 0) row0_after_1 = row;
          TESSERA_RETURN_IF_ERROR(kv.PushRows(kRowKey, {1}, g));
          TESSERA_RETURN_IF_ERROR(
              kv.PullRows(kRowKey, {0}, absl::MakeSpan(row)));
          if (kv.rank() == 0) row0_after_2 = row;
          TESSERA_RETURN_IF_ERROR(kv.PushRows(kRowKey, {1}, g));
          TESSERA_RETURN_IF_ERROR(
              kv.PullRows(kRowKey, {0}, absl::MakeSpan(row)));
          if (kv.rank() == 0) row0_after_3 = row;
          return absl::OkStatus();
        });
    for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(cluster.JoinScheduler().ok());
    ASSERT_EQ(row0_after_1.size(), kRowLen);
    EXPECT_NE(row0_after_1[0], 0.0f) << "row 0 was updated in round 1";
    // A dense update would keep moving row 0 (momentum, Adam's moments); a
    // lazy one leaves it, weights and state, until it has a gradient again.
    EXPECT_EQ(row0_after_2, row0_after_1);
    EXPECT_EQ(row0_after_3, row0_after_1);
  }
}

TEST(KVClientTest, RowSparseAsyncAppliesEveryPushOnce) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/3);
  InProcessCluster cluster(net, options);
  std::vector<std::vector<float>> got(3);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/false, [&](KVClient& kv) -> absl::Status {
        TESSERA_RETURN_IF_ERROR(kv.SetOptimizer("sgd lr=-1"));
        TESSERA_RETURN_IF_ERROR(kv.InitRows(kRowKey, nullptr, kRows, kRowLen));
        for (int i = 0; i < 20; ++i) {  // rows 7 and 250, 1 each, twice row 7
          TESSERA_RETURN_IF_ERROR(
              kv.PushRows(kRowKey, {7, 250, 7}, RowValues({1, 1, 1})));
        }
        TESSERA_RETURN_IF_ERROR(kv.Barrier());
        std::vector<float> out(3 * kRowLen);
        TESSERA_RETURN_IF_ERROR(
            kv.PullRows(kRowKey, {7, 250, 8}, absl::MakeSpan(out)));
        got[kv.rank()] = FirstOfRows(out);
        return absl::OkStatus();
      });
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(got[r], (std::vector<float>{3 * 20 * 2, 3 * 20, 0})) << r;
}

TEST(KVClientTest, RowSparseErrorsNameTheKeyAndIdAndApplyNothing) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/1);
  InProcessCluster cluster(net, options);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
        TESSERA_RETURN_IF_ERROR(kv.InitRows(kRowKey, nullptr, kRows, kRowLen));
        std::vector<float> dense(8, 0.0f);
        TESSERA_RETURN_IF_ERROR(kv.Init(41, dense));
        absl::Status s = kv.PushRows(kRowKey, {3, 300}, RowValues({1, 1}));
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(s.message()),
                    HasSubstr("key 40: row id 300 is past its 300 rows"));
        s = kv.PushRows(kRowKey, {3}, std::vector<float>(3, 1.0f));
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(s.message()), HasSubstr("need 4 values"));
        std::vector<float> out(kRowLen);
        s = kv.PullRows(41, {0}, absl::MakeSpan(out));
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(s.message()),
                    HasSubstr("key 41: the key is dense"));
        std::vector<float> whole(kRows * kRowLen);
        s = kv.Pull(kRowKey, absl::MakeSpan(whole));
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(s.message()),
                    HasSubstr("key 40: the key is row-sparse"));
        // Nothing was applied; the key still serves.
        TESSERA_RETURN_IF_ERROR(kv.PushRows(kRowKey, {3}, RowValues({2})));
        TESSERA_RETURN_IF_ERROR(kv.PullRows(kRowKey, {3}, absl::MakeSpan(out)));
        EXPECT_EQ(out, RowValues({2}));
        return absl::OkStatus();
      });
  ASSERT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(cluster.JoinScheduler().ok());
}

// Hashed row keys over three servers: any 64-bit ids (0, 2^64 - 1, big odd
// ones), spread by hash; with no optimizer each id's row becomes the exact
// sum of the round's pushes, rows never pushed read their initial row (the
// same on every worker), and later rounds change only the ids they name.
TEST(KVClientTest, HashedKeysSumAnyIdsExactlyAcrossServers) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/3, /*workers=*/2);
  InProcessCluster cluster(net, options);
  constexpr uint64_t kKey = 80, kLen = 3;
  const std::vector<uint64_t> ids = {
      0, ~uint64_t{0}, 0x8000000000000001ULL, 12345678901234567ULL, 42, 43, 44};
  const HashedSpec spec =
      *HashedSpec::Parse("init=uniform low=-1 high=1 seed=5");
  std::vector<std::vector<float>> got(2), fresh(2);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
        const int r = kv.rank();
        TESSERA_RETURN_IF_ERROR(
            kv.InitHashed(kKey, kLen, "init=uniform low=-1 high=1 seed=5"));
        // Round 1: everyone pushes every id (rank 1 in reverse, one twice).
        std::vector<uint64_t> mine = ids;
        if (r == 1) {
          std::reverse(mine.begin(), mine.end());
          mine.push_back(42);
        }
        std::vector<float> rows;
        for (uint64_t id : mine)
          for (uint64_t j = 0; j < kLen; ++j)
            rows.push_back(static_cast<float>(r + 1) * (j + 1) + (id % 7));
        TESSERA_RETURN_IF_ERROR(kv.PushRows(kKey, mine, rows));
        // Round 2: rank 0 pushes id 43 only, rank 1 nothing.
        if (r == 0) {
          TESSERA_RETURN_IF_ERROR(
              kv.PushRows(kKey, {43}, std::vector<float>(kLen, 100.0f)));
        } else {
          TESSERA_RETURN_IF_ERROR(kv.PushRows(kKey, {}, {}));
        }
        got[r].assign(ids.size() * kLen, 0);
        TESSERA_RETURN_IF_ERROR(kv.PullRows(kKey, ids, absl::MakeSpan(got[r])));
        fresh[r].assign(2 * kLen, 0);
        TESSERA_RETURN_IF_ERROR(
            kv.PullRows(kKey, {7, 1ULL << 63}, absl::MakeSpan(fresh[r])));
        return absl::OkStatus();
      });
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  for (int r = 0; r < 2; ++r) {
    for (size_t k = 0; k < ids.size(); ++k) {
      for (uint64_t j = 0; j < kLen; ++j) {
        const float one = 1.0f * (j + 1) + (ids[k] % 7);
        const float two = 2.0f * (j + 1) + (ids[k] % 7);
        float want = one + two + (ids[k] == 42 ? two : 0.0f);
        if (ids[k] == 43) want = 100.0f;
        EXPECT_EQ(got[r][k * kLen + j], want)
            << "id " << ids[k] << " col " << j;
      }
    }
    for (uint64_t j = 0; j < kLen; ++j) {
      EXPECT_EQ(fresh[r][j], spec.InitialValue(7, j));
      EXPECT_EQ(fresh[r][kLen + j], spec.InitialValue(1ULL << 63, j));
    }
  }
}

TEST(KVClientTest, HashedKeyErrorsNameTheOptionOrTheKey) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/1);
  InProcessCluster cluster(net, options);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
        absl::Status s = kv.InitHashed(90, 4, "admit_after=0");
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(s.message(),
                  "init of hashed key 90: hashed key option admit_after: "
                  "expected a whole number >= 1, got '0'");
        s = kv.InitHashed(90, 0, "");
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(s.message()), HasSubstr("rows of 0 values"));
        TESSERA_RETURN_IF_ERROR(kv.InitHashed(90, 4, "capacity=10"));
        s = kv.PushRows(90, {1ULL << 50}, std::vector<float>(3, 1.0f));
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(s.message()), HasSubstr("need 4 values"));
        std::vector<float> dense(4);
        s = kv.Pull(90, absl::MakeSpan(dense));
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
        // The key still serves.
        TESSERA_RETURN_IF_ERROR(
            kv.PushRows(90, {1ULL << 50}, std::vector<float>(4, 2.0f)));
        std::vector<float> out(4);
        TESSERA_RETURN_IF_ERROR(
            kv.PullRows(90, {1ULL << 50}, absl::MakeSpan(out)));
        EXPECT_EQ(out, std::vector<float>(4, 2.0f));
        return absl::OkStatus();
      });
  ASSERT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(cluster.JoinScheduler().ok());
}

// Row messages in frames of whole rows (RowsPerFrame), a key split over two
// servers: a push of many rows in many frames (small TESSERA_CHUNK_BYTES: 7
// rows a frame for a server's 300),
// a pull in many requests, or one request answered in several frames (a
// slice bigger than the server's 1 MiB reply frames); sorted ids (the push
// borrows the caller's rows) and unsorted ones with a repeat (gathered). Every
// row ends as the exact sum of what both workers pushed, both ways.
// With 4 KiB chunks each server's part (300 rows) is cut into slices of 64
// rows (5 a server, each its own round), and a push's slices of 32 rows
// (128 KiB) go two at a time (RowPushWindows: 16 chunks over the largest
// slice, at least 2); with 8 MiB chunks it is one slice.
TEST(KVClientTest, RowPushesAndPullsInManyFramesKeepEveryRowExact) {
  constexpr uint64_t kKey = 70, kNumRows = 600, kLen = 1024;
  for (const int64_t chunk : {int64_t{4096}, int64_t{8} << 20}) {
    MemoryNetwork net;
    // Split over both servers by rows (600 x 1024 values >= the bound).
    Options options = JobOptions(/*servers=*/2, /*workers=*/2);
    options.chunk_bytes = chunk;
    InProcessCluster cluster(net, options);
    auto value = [](int rank, uint64_t row, uint64_t j) {
      return static_cast<float>(rank + 1) + 0.5f * row + 0.25f * (j % 7);
    };
    std::vector<std::vector<float>> got(2);
    std::vector<absl::Status> results = RunWorkers(
        net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
          const int r = kv.rank();
          TESSERA_RETURN_IF_ERROR(kv.InitRows(kKey, nullptr, kNumRows, kLen));
          // Round 1: sorted ids, every even row. Round 2: odd rows from the
          // top down, row 1 twice.
          std::vector<uint64_t> even, odd;
          for (uint64_t row = 0; row < kNumRows; row += 2) even.push_back(row);
          for (uint64_t row = kNumRows - 1; row < kNumRows; row -= 2)
            odd.push_back(row);
          odd.push_back(1);
          for (const auto* ids : {&even, &odd}) {
            std::vector<float> rows(ids->size() * kLen);
            for (size_t k = 0; k < ids->size(); ++k)
              for (uint64_t j = 0; j < kLen; ++j)
                rows[k * kLen + j] = value(r, (*ids)[k], j);
            TESSERA_RETURN_IF_ERROR(kv.PushRows(kKey, *ids, rows));
          }
          std::vector<uint64_t> all(kNumRows);
          for (uint64_t row = 0; row < kNumRows; ++row)
            all[row] =
                (row * 7) % kNumRows;  // a permutation: 7 and 600 coprime
          got[r].assign(kNumRows * kLen, 0.0f);
          TESSERA_RETURN_IF_ERROR(
              kv.PullRows(kKey, all, absl::MakeSpan(got[r])));
          for (uint64_t k = 0; k < kNumRows; ++k) {
            const uint64_t row = all[k];
            const int times = row == 1 ? 2 : 1;
            for (uint64_t j = 0; j < kLen; ++j) {
              const float want = times * (value(0, row, j) + value(1, row, j));
              if (got[r][k * kLen + j] != want) {
                return absl::InternalError(absl::StrCat(
                    "chunk ", chunk, ": row ", row, " value ", j, " is ",
                    got[r][k * kLen + j], ", want ", want));
              }
            }
          }
          return absl::OkStatus();
        });
    for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(cluster.JoinScheduler().ok());
  }
}

// With pull compression, row pulls travel as bfloat16 (2 bytes a value, no
// state): each value arrives rounded to the nearest bfloat16, ties to even,
// from rows spread over two servers, and a row pull's bytes are half the
// float32 ones.
TEST(KVClientTest, RowPullsUnderPullCompressionComeAsBfloat16) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/2);
  InProcessCluster cluster(net, options);
  // Per row: 1 + 2^-8 (a tie: to 1, the even one), 1 + 3 x 2^-9 (up to
  // 1 + 2^-7), -3.3 (to -3.296875), 1e-40 (subnormal: to 9.99e-41's bf16).
  const std::vector<float> values = {1.0f + 0.00390625f, 1.0f + 0.005859375f,
                                     -3.3f, 1e-40f};
  std::vector<float> want(values.size());
  for (size_t j = 0; j < values.size(); ++j) {
    uint32_t bits;
    std::memcpy(&bits, &values[j], 4);
    const uint32_t lsb = (bits >> 16) & 1;
    bits = ((bits + 0x7fff + lsb) >> 16) << 16;
    std::memcpy(&want[j], &bits, 4);
  }
  EXPECT_EQ(want[0], 1.0f);
  EXPECT_EQ(want[1], 1.0078125f);
  EXPECT_EQ(want[2], -3.296875f);
  std::vector<std::vector<float>> got(2);
  std::vector<uint64_t> pulled_bytes(2);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
        TESSERA_RETURN_IF_ERROR(kv.SetPullCompression("2bit"));
        std::vector<float> init(kRows * kRowLen);
        for (uint64_t r = 0; r < kRows; ++r)
          for (uint64_t j = 0; j < kRowLen; ++j)
            init[r * kRowLen + j] = values[j];
        TESSERA_RETURN_IF_ERROR(
            kv.InitRows(kRowKey, init.data(), kRows, kRowLen));
        const uint64_t before = kv.stats().bytes_pulled;
        std::vector<float> out(3 * kRowLen);
        TESSERA_RETURN_IF_ERROR(
            kv.PullRows(kRowKey, {299, 0, 150}, absl::MakeSpan(out)));
        got[kv.rank()] = out;
        pulled_bytes[kv.rank()] = kv.stats().bytes_pulled - before;
        return absl::OkStatus();
      });
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  for (int r = 0; r < 2; ++r) {
    for (size_t k = 0; k < 3; ++k) {
      for (size_t j = 0; j < kRowLen; ++j)
        EXPECT_EQ(got[r][k * kRowLen + j], want[j])
            << r << " " << k << " " << j;
    }
    EXPECT_EQ(pulled_bytes[r], 3 * kRowLen * 2) << r;
  }
}

TEST(KVClientTest, RowSparseTwoBitPushesKeepErrorFeedbackPerRow) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/1, /*workers=*/1);
  InProcessCluster cluster(net, options);
  // The reference: each row's residual, as MXNet's 2-bit rule keeps it.
  std::map<uint64_t, std::vector<float>> residual;
  std::vector<float> reference(10 * kRowLen, 0.0f);
  const std::vector<std::vector<uint64_t>> rounds = {
      {1, 2}, {2}, {1, 5, 1}, {}};
  std::vector<std::vector<float>> got;
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true, [&](KVClient& kv) -> absl::Status {
        TESSERA_RETURN_IF_ERROR(kv.SetGradientCompression("2bit", 0.5f));
        TESSERA_RETURN_IF_ERROR(kv.InitRows(kRowKey, nullptr, 10, kRowLen));
        for (size_t k = 0; k < rounds.size(); ++k) {
          std::vector<float> grad;
          for (size_t i = 0; i < rounds[k].size(); ++i) {
            for (uint64_t j = 0; j < kRowLen; ++j)
              grad.push_back(0.3f * (j + 1) - 0.2f * i + 0.1f * k);
          }
          TESSERA_RETURN_IF_ERROR(kv.PushRows(kRowKey, rounds[k], grad));
          // No optimizer: the rows present become the round's sum, i.e. the
          // decoded push (duplicates summed before coding).
          std::map<uint64_t, std::vector<float>> summed;
          std::vector<uint64_t> order;
          for (size_t i = 0; i < rounds[k].size(); ++i) {
            auto& row = summed[rounds[k][i]];
            if (row.empty()) {
              row.assign(kRowLen, 0.0f);
              order.push_back(rounds[k][i]);
            }
            for (uint64_t j = 0; j < kRowLen; ++j)
              row[j] += grad[i * kRowLen + j];
          }
          for (uint64_t id : order) {
            auto& r = residual[id];
            if (r.empty()) r.assign(kRowLen, 0.0f);
            std::vector<uint8_t> packed(
                compression::TwoBitCompressedBytes(kRowLen));
            EXPECT_TRUE(compression::TwoBitQuantize(summed[id].data(), r.data(),
                                                    kRowLen, 0.5f,
                                                    packed.data())
                            .ok());
            EXPECT_TRUE(compression::TwoBitDequantize(
                            packed.data(), packed.size(), kRowLen, 0.5f,
                            reference.data() + id * kRowLen)
                            .ok());
          }
          std::vector<float> out(10 * kRowLen);
          std::vector<uint64_t> all = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
          TESSERA_RETURN_IF_ERROR(
              kv.PullRows(kRowKey, all, absl::MakeSpan(out)));
          got.push_back(out);
          EXPECT_EQ(out, reference) << "round " << k;
        }
        return absl::OkStatus();
      });
  ASSERT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_EQ(got.size(), rounds.size());
}

TEST(KVClientTest, RowSparsePushesOverLossyLinksAreAppliedOnce) {
  MemoryNetwork net;
  const Options options = JobOptions(/*servers=*/2, /*workers=*/2);
  InProcessCluster cluster(net, options);
  std::vector<std::vector<float>> got(2);
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true,
      [&](KVClient& kv) -> absl::Status {
        TESSERA_RETURN_IF_ERROR(kv.SetOptimizer("sgd lr=-1"));
        TESSERA_RETURN_IF_ERROR(kv.InitRows(kRowKey, nullptr, kRows, kRowLen));
        for (int i = 0; i < 30; ++i) {
          TESSERA_RETURN_IF_ERROR(
              kv.PushRows(kRowKey, {5, 160}, RowValues({1, 2})));
        }
        std::vector<float> out(2 * kRowLen);
        TESSERA_RETURN_IF_ERROR(
            kv.PullRows(kRowKey, {5, 160}, absl::MakeSpan(out)));
        got[kv.rank()] = FirstOfRows(out);
        return absl::OkStatus();
      },
      [&](int) -> std::unique_ptr<Transport> {
        return std::make_unique<LossyTransport>(net.NewTransport(), 5, 7);
      });
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  EXPECT_GT(cluster.duplicates(), 0u);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(got[r], (std::vector<float>{60, 120}));
}

// Issue #48: what priority each request and its reply carry on the wire.
struct WireRecord {
  bool reply = false;
  wire::Command command = wire::KV_PUSH;
  uint64_t key = 0;
  std::optional<int32_t> priority;
};

class PriorityLog {
 public:
  void Add(bool reply, const wire::Header& h) {
    if (h.plane() != wire::DATA || !h.has_slice()) return;
    absl::MutexLock lock(&mu_);
    records_.push_back({reply, h.command(), h.slice().key(),
                        h.has_priority() ? std::optional<int32_t>(h.priority())
                                         : std::nullopt});
  }
  std::vector<WireRecord> records() const {
    absl::MutexLock lock(&mu_);
    return records_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<WireRecord> records_ ABSL_GUARDED_BY(mu_);
};

// Records every data-plane message with a key slice a worker sends and
// receives.
class PriorityTap : public ForwardingTransport {
 public:
  PriorityTap(std::unique_ptr<Transport> inner,
              std::shared_ptr<PriorityLog> log)
      : ForwardingTransport(std::move(inner)), log_(std::move(log)) {}
  absl::Status Send(int peer, const Message& msg) override {
    log_->Add(false, msg.header);
    return ForwardingTransport::Send(peer, msg);
  }
  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    absl::StatusOr<Message> msg = ForwardingTransport::Receive(timeout);
    if (msg.ok()) log_->Add(true, msg->header);
    return msg;
  }

 private:
  std::shared_ptr<PriorityLog> log_;
};

// Keys 10, 20 and 30 in that order: priorities 0, -1 and -2 by default; key
// 30 then set to 7. Each key pushed and pulled once. Returns the log.
std::vector<WireRecord> PrioritisedJob(bool send_priority) {
  MemoryNetwork net;
  Options options = JobOptions(/*servers=*/1, /*workers=*/1);
  options.send_priority = send_priority;
  InProcessCluster cluster(net, options);
  auto log = std::make_shared<PriorityLog>();
  std::vector<absl::Status> results = RunWorkers(
      net, options, /*sync=*/true,
      [&](KVClient& kv) -> absl::Status {
        const std::vector<float> v(4, 1.0f);
        TESSERA_RETURN_IF_ERROR(kv.SetOptimizer("sgd lr=0.5"));
        for (uint64_t key : {10, 20, 30})
          TESSERA_RETURN_IF_ERROR(kv.Init(key, v));
        EXPECT_EQ(*kv.Priority(10), 0);
        EXPECT_EQ(*kv.Priority(20), -1);
        EXPECT_EQ(*kv.Priority(30), -2);
        TESSERA_RETURN_IF_ERROR(kv.SetPriority(30, 7));
        EXPECT_EQ(*kv.Priority(30), 7);
        absl::Status unknown = kv.SetPriority(99, 1);
        EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
        EXPECT_EQ(unknown.message(),
                  "cannot set the priority of key 99: it is not initialised "
                  "here (Init it first)");
        absl::Status bad = kv.SetPriority(10, int64_t{3} << 40);
        EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(bad.message(),
                  "the priority of key 10 is 3298534883328: expected an "
                  "integer from -1000000000 to 1000000000 (higher is more "
                  "urgent)");
        EXPECT_EQ(*kv.Priority(10), 0) << "a refused priority changes nothing";
        std::vector<float> out(4);
        for (uint64_t key : {10, 20, 30}) {
          TESSERA_RETURN_IF_ERROR(kv.Push(key, v));
          TESSERA_RETURN_IF_ERROR(kv.Pull(key, absl::MakeSpan(out)));
        }
        return absl::OkStatus();
      },
      [&](int) {
        return std::make_unique<PriorityTap>(net.NewTransport(), log);
      });
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(cluster.JoinScheduler().ok());
  return log->records();
}

TEST(KVClientTest, RequestsAndRepliesCarryTheirKeysPriority) {
  const std::map<uint64_t, int32_t> want = {{10, 0}, {20, -1}, {30, 7}};
  int pushes = 0, pulls = 0, replies = 0;
  for (const WireRecord& r : PrioritisedJob(/*send_priority=*/true)) {
    if (r.command == wire::KV_INIT) {
      EXPECT_FALSE(r.priority.has_value()) << "inits carry none";
      continue;
    }
    ASSERT_TRUE(r.priority.has_value())
        << (r.reply ? "reply" : "request") << " of key " << r.key;
    EXPECT_EQ(*r.priority, want.at(r.key)) << "key " << r.key;
    replies += r.reply;
    pushes += !r.reply && r.command == wire::KV_PUSH;
    pulls += !r.reply && r.command == wire::KV_PULL;
  }
  EXPECT_GE(pushes, 3);
  EXPECT_GE(pulls, 3);
  EXPECT_GE(replies, 6);
}

TEST(KVClientTest, WithFifoNoRequestCarriesAPriority) {
  int data = 0;
  for (const WireRecord& r : PrioritisedJob(/*send_priority=*/false)) {
    EXPECT_FALSE(r.priority.has_value())
        << (r.reply ? "reply" : "request") << " of key " << r.key;
    ++data;
  }
  EXPECT_GE(data, 12);
}

}  // namespace
}  // namespace tessera
