// The rogue-node harness (issue #46), a rogue server: a server of the job,
// with its valid per-process key, answers and forges what its place may not.
// The job is sealed, with per-process keys (launch.py's roster): three
// servers holding every slice twice (TESSERA_REPLICAS=2; the chains of the
// big key's parts are [0, 1], [1, 2] and [2, 0]), servers 0 and 1 real
// processes, server 2 this test (a KVServer and its Node on the test's
// threads, serving honestly, over a transport the test keeps), and worker B,
// also this test (a KVClient over a transport it wraps). Between B's rounds
// server 2 sends:
//   - a pull reply and a push acknowledgement, with made-up values, to B's
//     real requests in flight to server 0 (a chain server 2 is not in), and
//     to those to server 1, alive (whose chain [1, 2] server 2 is the
//     backup of: a backup answers only after a fail-over re-aimed a request
//     to it);
//   - replica updates: to server 1 for its own slice (server 2 is its
//     backup, and a backup sends no updates), to servers 0 and 1 for the
//     slice of chain [0, 1] (a chain it is not in);
//   - a transfer to server 1 of the slice of chain [0, 1];
//   - a hand-back notice to server 0, a hand-back's report and a
//     replacement's report to the scheduler (none was asked for).
// Each scene: B's pulled values are bit-equal to a clean run of the same job,
// every process exits 0, the attempt is dropped and counted, and the refusing
// node's log names server 2.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/key_layout.h"
#include "common/message.h"
#include "common/metrics.h"
#include "common/node.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/kv_server.h"
#include "tests/core/cluster_expect.h"
#include "tests/core/process_cluster.h"
#include "tests/core/roster.h"
#include "tests/support/forwarding_transport.h"
#include "worker/client/kv_client.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kBig = 7;
constexpr size_t kBigLen = 300000;  // a part on each server
constexpr uint64_t kSmall = 3;
constexpr size_t kSmallLen = 6;
constexpr int kRounds = 4;  // before the attack, and again after it
constexpr int kRogueRank = 2;

Options InProcessOptions(ProcessCluster& c, const std::string& role,
                         const std::string& key_file, int task_id) {
  std::map<std::string, std::string> env = {
      {"DMLC_ROLE", role},
      {"DMLC_PS_ROOT_URI", "127.0.0.1"},
      {"DMLC_PS_ROOT_PORT", std::to_string(c.port())},
      {"DMLC_NUM_SERVER", "3"},
      {"DMLC_NUM_WORKER", "1"},
      {"TESSERA_REPLICAS", "2"},
      {"TESSERA_KEY_FILE", key_file},
      {"TESSERA_START_TIMEOUT", "30"},
      {"DMLC_TASK_ID", std::to_string(task_id)},
      {"TESSERA_BIGARRAY_BOUND", "1000"},  // the big key split in 3 parts
  };
  absl::StatusOr<Options> o =
      ParseOptions([&](const std::string& name) -> std::optional<std::string> {
        auto it = env.find(name);
        if (it == env.end()) return std::nullopt;
        return it->second;
      });
  EXPECT_TRUE(o.ok()) << o.status();
  return *o;
}

// Server 2: a KVServer and its Node, as tessera-server runs them (without
// checkpoints), on a thread of its own from construction to the job's end.
class RogueServer {
 public:
  explicit RogueServer(Options options) : options_(std::move(options)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~RogueServer() { Join(); }

  // Joined the job (and serves it) within `bound`.
  bool WaitStarted(absl::Duration bound) {
    return started_.WaitForNotificationWithTimeout(bound) && transport_;
  }
  Transport& transport() { return *transport_; }
  int id() const { return ServerId(kRogueRank); }
  // After Join: how its node ended, and its counts.
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  const absl::Status& result() const { return result_; }
  const wire::KVStats& stats() const { return stats_; }

 private:
  void Run() {
    absl::StatusOr<std::unique_ptr<Transport>> made =
        NewZmqTransportForNode(options_);
    if (!made.ok()) {
      result_ = made.status();
      started_.Notify();
      return;
    }
    Transport* transport = made->get();
    KVServer server(options_.num_workers, 1, [this](int peer, Message m) {
      return node_->Send(peer, std::move(m));
    });
    Node::Callbacks callbacks;
    callbacks.on_data = [&server](Message&& m) { server.Handle(std::move(m)); };
    auto changed = [this, &server](int peer) {
      if (IsServerId(peer) && live_.load())
        server.UpdateServers(node_->server_states());
    };
    callbacks.on_peer_dead = changed;
    callbacks.on_server_change = changed;
    absl::StatusOr<std::unique_ptr<Node>> started =
        Node::Start(options_, std::move(callbacks), *std::move(made));
    if (!started.ok()) {
      result_ = started.status();
      started_.Notify();
      return;
    }
    node_ = *std::move(started);
    EXPECT_EQ(node_->rank(), kRogueRank);
    server.set_on_workers_finished([this] { node_->MarkPartDone(); });
    server.set_replication(node_->rank(), options_.num_servers,
                           options_.chain_length(), options_.resend_timeout,
                           options_.single_copy);
    live_.store(true);
    server.UpdateServers(node_->server_states());
    node_->StartDelivery();
    transport_ = transport;
    started_.Notify();
    result_ = node_->WaitForTerminate();
    stats_ = server.stats();
    node_->Stop();
    server.Stop();
  }

  const Options options_;
  std::thread thread_;
  absl::Notification started_;
  Transport* transport_ = nullptr;  // set before started_
  std::unique_ptr<Node> node_;
  std::atomic<bool> live_{false};
  absl::Status result_;
  wire::KVStats stats_;
};

uint64_t WrongServerReplies() {
  return MetricsRegistry::Global()
      .GetCounter("tessera_worker_wrong_server_replies_total", "")
      ->value();
}

// B's transport: once armed, the first push and the first pull B sends to
// server 0, and to server 1, are answered first by server 2 (a forged reply,
// carrying the real request's id), and go on once B has dropped that answer.
class Interceptor : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;

  void Arm(RogueServer* rogue, int b_id) {
    absl::MutexLock lock(&mu_);
    rogue_ = rogue;
    b_id_ = b_id;
  }
  int forged() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(answered_.size());
  }

  absl::Status Send(int peer, const Message& msg) override {
    const wire::Command command = msg.header.command();
    if ((peer == ServerId(0) || peer == ServerId(1)) &&
        !msg.header.is_response() &&
        (command == wire::KV_PUSH || command == wire::KV_PULL)) {
      Message forged;
      {
        absl::MutexLock lock(&mu_);
        if (rogue_ != nullptr && answered_.emplace(peer, command).second)
          forged = Answer(msg);
      }
      if (forged.header.is_response()) Forge(std::move(forged));
    }
    return inner_->Send(peer, msg);
  }

 private:
  Message Answer(const Message& request) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    static const std::vector<float> values(kBigLen, 1e6f);
    Message reply;
    reply.header = request.header;
    reply.header.clear_frames();
    reply.header.set_is_response(true);
    reply.header.set_sender(ServerId(kRogueRank));
    reply.header.set_recipient(b_id_);
    if (request.header.command() == wire::KV_PULL) {
      AddFloatFrame(&reply,
                    Buffer::Wrap(values.data(),
                                 request.header.slice().length() * 4, nullptr));
    }
    return reply;
  }
  // Sends `reply` from server 2 and waits (5 s at most) until B dropped it,
  // before B's request reaches server 0 (whose real answer would come first).
  void Forge(Message reply) {
    const uint64_t before = WrongServerReplies();
    RogueServer* rogue;
    {
      absl::MutexLock lock(&mu_);
      rogue = rogue_;
    }
    EXPECT_TRUE(rogue->transport().Send(reply.header.recipient(), reply).ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (WrongServerReplies() == before && absl::Now() < deadline)
      absl::SleepFor(absl::Milliseconds(1));
  }

  mutable absl::Mutex mu_;
  RogueServer* rogue_ ABSL_GUARDED_BY(mu_) = nullptr;
  int b_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::pair<int, wire::Command>> answered_ ABSL_GUARDED_BY(mu_);
};

struct Outcome {
  std::vector<float> big, small;                     // B's last pulls
  std::vector<std::pair<int64_t, int64_t>> applied;  // per server rank
  uint64_t wrong_server_replies = 0;
  std::string scheduler, server0, server1, worker_b;
  wire::KVStats rogue;
};

// B's rounds: push a gradient made of the round's number, pull both keys.
void Rounds(KVClient& b, int first, int count, Outcome* out) {
  std::vector<float> grad(kBigLen), small_grad(kSmallLen);
  for (int r = first; r < first + count; ++r) {
    for (size_t i = 0; i < kBigLen; ++i)
      grad[i] = static_cast<float>((r + 1) * (i % 5 + 1)) * 0.125f;
    for (size_t i = 0; i < kSmallLen; ++i)
      small_grad[i] = static_cast<float>(r) - 0.5f * static_cast<float>(i);
    for (const auto& [key, values] :
         {std::pair<uint64_t, std::vector<float>*>{kBig, &grad},
          {kSmall, &small_grad}}) {
      absl::StatusOr<OpHandle> p = b.PushAsync(key, *values);
      ASSERT_TRUE(p.ok()) << p.status();
      const absl::Status waited = b.Wait(*p);
      ASSERT_TRUE(waited.ok()) << waited;
    }
    for (const auto& [key, values] :
         {std::pair<uint64_t, std::vector<float>*>{kBig, &out->big},
          {kSmall, &out->small}}) {
      absl::StatusOr<OpHandle> p = b.PullAsync(key, absl::MakeSpan(*values));
      ASSERT_TRUE(p.ok()) << p.status();
      const absl::Status waited = b.Wait(*p);
      ASSERT_TRUE(waited.ok()) << waited;
    }
  }
}

// A server-to-server message from server 2 about the first slice of the big
// key's part `part` (whose chain is [part, part + 1]).
Message FromRogue(wire::Command command, int part, wire::Plane plane) {
  Message m;
  m.header.set_command(command);
  m.header.set_sender(ServerId(kRogueRank));
  m.header.set_plane(plane);
  m.header.set_request_id((uint64_t{1} << 44) + 1);
  if (plane != wire::DATA) return m;
  wire::KeySlice* slice = m.header.mutable_slice();
  slice->set_key(kBig);
  slice->set_offset(SplitPartBegin(kBigLen, part, 3));
  m.header.set_replica_seq(1000);
  return m;
}

// An update of 1000 made-up values, as its primary would send it.
Message Update(int part) {
  static const std::vector<float> values(1000, 1e6f);
  Message m = FromRogue(wire::KV_REPLICATE, part, wire::DATA);
  m.header.add_replica_counts(1000);
  AddFloatFrame(&m, Buffer::Wrap(values.data(), values.size() * 4, nullptr));
  return m;
}

// A transfer of the slice (as place `place` of its chain), well formed.
Message Transfer(int part, uint32_t place) {
  Message m = FromRogue(wire::KV_TRANSFER, part, wire::DATA);
  m.header.set_replica(place);
  wire::ServerCheckpoint saved;
  wire::CheckpointKey* k = saved.add_keys();
  k->set_key(kBig);
  k->set_offset(m.header.slice().offset());
  k->set_replica_seq(m.header.replica_seq());
  k->set_replica(place);
  const std::string bytes = saved.SerializeAsString();
  Buffer frame = Buffer::Allocate(bytes.size());
  std::memcpy(frame.mutable_data(), bytes.data(), bytes.size());
  AddRawFrame(&m, std::move(frame));
  return m;
}

// Server 2's forged server-to-server and control messages.
void Attack(Transport& t) {
  // Updates: from server 1's backup to it; for chain [0, 1] to both.
  EXPECT_TRUE(t.Send(ServerId(1), Update(1)).ok());
  EXPECT_TRUE(t.Send(ServerId(1), Update(0)).ok());
  EXPECT_TRUE(t.Send(ServerId(0), Update(0)).ok());
  // The slice of chain [0, 1], as server 1's place in it.
  EXPECT_TRUE(t.Send(ServerId(1), Transfer(0, 1)).ok());
  // A hand-back nobody started: the notice to a server, the report to the
  // scheduler; a replacement's report from a server that replaced nobody.
  Message notice = FromRogue(wire::HANDBACK, 0, wire::CONTROL);
  notice.header.set_handback_rank(0);
  notice.header.set_handback_epoch(99);
  EXPECT_TRUE(t.Send(ServerId(0), notice).ok());
  Message report = FromRogue(wire::HANDBACK, 0, wire::CONTROL);
  report.header.set_handback_epoch(99);
  EXPECT_TRUE(t.Send(kSchedulerId, report).ok());
  EXPECT_TRUE(
      t.Send(kSchedulerId, FromRogue(wire::CAUGHT_UP, 0, wire::CONTROL)).ok());
}

Outcome RunJob(bool attack) {
  Outcome out;
  out.big.assign(kBigLen, 0.0f);
  out.small.assign(kSmallLen, 0.0f);
  ProcessCluster c;
  c.Env("DMLC_NUM_SERVER", "3");
  c.Env("DMLC_NUM_WORKER", "1");
  c.Env("TESSERA_REPLICAS", "2");
  const Roster nodes(c, {"server 0", "server 1", "server 2", "worker 0"});
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"},
           {"TESSERA_KEY_FILE", nodes.scheduler_file()}});
  for (int s = 0; s < 2; ++s) {
    c.Spawn(absl::StrCat("server ", s), {BinaryPath("server/tessera-server")},
            {{"DMLC_ROLE", "server"},
             {"TESSERA_KEY_FILE", nodes[s].file},
             {"DMLC_TASK_ID", std::to_string(s)}});
  }
  RogueServer rogue(
      InProcessOptions(c, "server", nodes[kRogueRank].file, kRogueRank));
  const Options options = InProcessOptions(c, "worker", nodes[3].file, 3);
  absl::StatusOr<std::unique_ptr<Transport>> made =
      NewZmqTransportForNode(options);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return out;
  auto interceptor = std::make_unique<Interceptor>(*std::move(made));
  Interceptor* b_transport = interceptor.get();
  const uint64_t wrong_before = WrongServerReplies();
  if (attack) ::testing::internal::CaptureStderr();
  absl::StatusOr<std::unique_ptr<KVClient>> b =
      KVClient::Create(options, /*sync=*/false, std::move(interceptor));
  EXPECT_TRUE(b.ok()) << b.status() << c.AllLogs();
  EXPECT_TRUE(rogue.WaitStarted(absl::Seconds(30))) << rogue.result();
  if (b.ok() && rogue.WaitStarted(absl::ZeroDuration())) {
    KVClient& worker = **b;
    std::vector<float> big(kBigLen), small(kSmallLen);
    for (size_t i = 0; i < kBigLen; ++i) big[i] = static_cast<float>(i % 97);
    for (size_t i = 0; i < kSmallLen; ++i) small[i] = static_cast<float>(i) + 1;
    EXPECT_TRUE(worker.SetOptimizer("sgd lr=-1").ok());
    EXPECT_TRUE(worker.Init(kBig, big).ok());
    EXPECT_TRUE(worker.Init(kSmall, small).ok());
    EXPECT_TRUE(worker.Barrier().ok());
    Rounds(worker, 0, kRounds, &out);
    if (attack) {
      Attack(rogue.transport());
      b_transport->Arm(&rogue, WorkerId(worker.rank()));
    }
    Rounds(worker, kRounds, kRounds, &out);
    EXPECT_TRUE(worker.Barrier().ok());
    EXPECT_TRUE(worker.Close().ok());
  }
  if (b.ok()) b->reset();
  rogue.Join();
  EXPECT_TRUE(rogue.result().ok()) << rogue.result();
  if (attack) out.worker_b = ::testing::internal::GetCapturedStderr();
  out.wrong_server_replies = WrongServerReplies() - wrong_before;
  ExpectAllExitZero(c, absl::Seconds(60));
  out.scheduler = ProcessCluster::Log(c.Find("scheduler"));
  out.server0 = ProcessCluster::Log(c.Find("server 0"));
  out.server1 = ProcessCluster::Log(c.Find("server 1"));
  out.rogue = rogue.stats();
  for (const std::string* log : {&out.server0, &out.server1}) {
    out.applied.emplace_back(SummaryCount(*log, "pushes applied"),
                             SummaryCount(*log, "replica updates"));
  }
  out.applied.emplace_back(out.rogue.pushes_applied(),
                           out.rogue.replica_updates());
  return out;
}

TEST(RogueServerTest, AServerWithValidKeysGetsNowhereAndTheResultIsUnchanged) {
  const Outcome clean = RunJob(/*attack=*/false);
  const Outcome rogue = RunJob(/*attack=*/true);
  ASSERT_FALSE(HasFailure());
  // The result, bit for bit, and not the initial values; every server
  // applied the same pushes and replica updates.
  EXPECT_EQ(std::memcmp(clean.big.data(), rogue.big.data(), kBigLen * 4), 0);
  EXPECT_EQ(std::memcmp(clean.small.data(), rogue.small.data(), kSmallLen * 4),
            0);
  EXPECT_NE(clean.big[1], 1.0f);
  EXPECT_EQ(rogue.applied, clean.applied);
  EXPECT_GT(clean.applied[0].first, 0);
  EXPECT_GT(clean.applied[1].second, 0);
  // Answers to B's requests to server 0 and to server 1 (whose backup
  // server 2 is): dropped, counted, naming server 2.
  EXPECT_EQ(clean.wrong_server_replies, 0u);
  EXPECT_EQ(rogue.wrong_server_replies, 4u) << rogue.worker_b;
  for (int n = 1; n <= 4; ++n) {
    EXPECT_THAT(rogue.worker_b,
                HasSubstr(absl::StrCat("dropped reply #", n, " to request ")));
  }
  EXPECT_THAT(rogue.worker_b, HasSubstr(" from server 2 (id "));
  EXPECT_THAT(rogue.worker_b, HasSubstr(": it was sent to server 0 (id "));
  EXPECT_THAT(rogue.worker_b, HasSubstr(": it was sent to server 1 (id "));
  // Updates and the transfer: one at server 0, three at server 1, naming
  // server 2; none taken as malformed.
  for (const Outcome* o : {&clean, &rogue}) {
    EXPECT_EQ(SummaryCount(o->server0, "misplaced server messages"),
              o == &rogue ? 1 : 0)
        << o->server0;
    EXPECT_EQ(SummaryCount(o->server1, "misplaced server messages"),
              o == &rogue ? 3 : 0)
        << o->server1;
    EXPECT_EQ(SummaryCount(o->server0, "malformed"), 0);
    EXPECT_EQ(SummaryCount(o->server1, "malformed"), 0);
    // The hand-back notice at server 0 (a control message from a server).
    EXPECT_EQ(SummaryCount(o->server0, "wrong sender"), o == &rogue ? 1 : 0)
        << o->server0;
    EXPECT_EQ(SummaryCount(o->server1, "wrong sender"), 0);
  }
  const std::string from = absl::StrCat("from server 2 (node id ",
                                        ServerId(kRogueRank), "): the slice's");
  EXPECT_THAT(rogue.server1, HasSubstr("dropped update 1000 of key 7 offset " +
                                       std::to_string(kBigLen / 3) + " " +
                                       from + " chain is [1, 2]"));
  EXPECT_THAT(rogue.server1,
              HasSubstr("dropped update 1000 of key 7 offset 0 " + from));
  EXPECT_THAT(rogue.server1,
              HasSubstr("dropped transfer 1000 of key 7 offset 0 " + from));
  EXPECT_THAT(rogue.server0,
              HasSubstr("dropped update 1000 of key 7 offset 0 " + from));
  // The hand-back notice: counted (above) and logged, naming server 2; the
  // reports are taken as late ones and change nothing.
  EXPECT_THAT(rogue.server0,
              HasSubstr(absl::StrCat("ignored control message #1 from server "
                                     "2 (id ",
                                     ServerId(kRogueRank))));
  EXPECT_THAT(rogue.scheduler, Not(HasSubstr("caught up")));
  EXPECT_THAT(rogue.scheduler, Not(HasSubstr("took back its place")));
}

}  // namespace
}  // namespace tessera::testing
