// The rogue-node harness (issue #46), short form: a node of the job with valid
// keys of its role behaves badly, scene after scene, against real daemons. The
// job is sealed, with per-process keys (launch.py's roster), two servers
// holding every slice twice (TESSERA_REPLICAS=2), worker A (kv_check_worker
// "barrier") and worker B, this test: a real KVClient over a ZeroMQ transport
// the test keeps a pointer to. B does honest work (dist_async pushes and pulls
// of a key split over both servers, and a small key) and, between its rounds,
// sends what a compromised worker would:
//   - a sealed REGISTER for a second worker rank, and one as a spare server;
//   - replica updates and transfers (server-to-server messages), in its name;
//   - a replacement's and a hand-back's reports, and a server's goodbye;
//   - answers to requests meant for a server, to worker A, in its name and in
//     server 0's;
//   - a replica update in server 0's name;
//   - registrations over its own main (CURVE) link, as a restart of its own
//     rank, claiming server 0's sealed node key, then its bit-255 twin, then
//     a key not below 2^255 - 19 (the scheduler refuses each and counts it in
//     its exit line's "ignored messages"; server 0 goes on).
// Each scene: the job's result is bit-equal to a clean run of the same job
// (B's pulled values; every process exits 0), the attempt is refused and
// counted, and the rogue (worker id N) is named in the refusing node's log.
// B's sealed links to the servers go through TcpTap relays of the test (in
// both runs), which keep B's first session with each: replayed at the end of
// the attack (records of inits and pushes), they are dropped as replayed.
//
// B seals with a node key the test made (ZmqTransportOptions::node_secret),
// so the test also seals on B's link to a server, next in its order, two
// pushes announcing 8 GiB of frames (8 of 1 GiB, the bound each, in a record
// marked last; one of 8 GiB): both dropped as malformed, nothing allocated.
//
// Last, after B's handshake on a connection of its own, 300 records of node
// keys no node holds, sent over B's connection, are all dropped there.
//
// Not here, and where it is tested: records sealed with a bit-255 twin of a
// held node key: sealed_link_test and node_test.
#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/curve_keys.h"
#include "common/message.h"
#include "common/sealed_admission.h"
#include "common/sealed_link.h"
#include "common/transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/cluster_expect.h"
#include "tests/core/process_cluster.h"
#include "tests/core/roster.h"
#include "tests/support/forwarding_transport.h"
#include "tests/support/sealed_session.h"
#include "tests/support/tcp_tap.h"
#include "worker/client/kv_client.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kBig = 7;
constexpr size_t kBigLen = 400000;  // 1.6 MB: slices on both servers
constexpr uint64_t kSmall = 3;
constexpr size_t kSmallLen = 6;
constexpr int kRounds = 6;  // before the attack, and again after it

Options RogueOptions(ProcessCluster& c, const std::string& key_file) {
  std::map<std::string, std::string> env = {
      {"DMLC_ROLE", "worker"},
      {"DMLC_PS_ROOT_URI", "127.0.0.1"},
      {"DMLC_PS_ROOT_PORT", std::to_string(c.port())},
      {"DMLC_NUM_SERVER", "2"},
      {"DMLC_NUM_WORKER", "2"},
      {"TESSERA_REPLICAS", "2"},
      {"TESSERA_KEY_FILE", key_file},
      {"TESSERA_START_TIMEOUT", "30"},
      {"DMLC_TASK_ID", "3"},  // before worker A's: rank 0, which inits
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

Message Forged(wire::Command command, int sender, wire::Plane plane) {
  Message m;
  m.header.set_command(command);
  m.header.set_sender(sender);
  m.header.set_plane(plane);
  m.header.set_request_id((uint64_t{1} << 44) + 1);
  return m;
}

// A server-to-server message about the first slice of the big key, with its
// values.
Message ForgedSlice(wire::Command command, int sender) {
  static const std::vector<float> values(1000, 1e6f);
  Message m = Forged(command, sender, wire::DATA);
  wire::KeySlice* slice = m.header.mutable_slice();
  slice->set_key(kBig);
  slice->set_offset(0);
  slice->set_length(values.size());
  slice->set_total_length(kBigLen);
  m.header.set_replica(1);
  m.header.set_replica_seq(1000);
  AddFloatFrame(&m, Buffer::Wrap(values.data(), values.size() * 4, nullptr));
  return m;
}

// A registration, unsealed in form (it claims no sender): a worker at a port
// nobody listens on, or a spare server there.
Message Registration(wire::Role role, int port) {
  Message reg = Forged(wire::REGISTER, 0, wire::CONTROL);
  wire::Register* r = reg.header.mutable_register_();
  wire::NodeInfo* info = r->mutable_node();
  info->set_role(role);
  info->set_rank(-1);
  info->set_host("127.0.0.1");
  info->set_port(port);
  info->set_node_key(std::string(32, '\x07'));
  info->set_sealed_port(1);
  if (role == wire::SERVER) r->set_spare(true);
  return reg;
}

struct Outcome {
  std::vector<float> big, small;  // B's last pulls
  int b_id = 0;
  int rogue_port = 0;
  int b_port = 0;           // B's own address: 127.0.0.1:b_port
  std::string claimed_key;  // server 0's sealed node key
  std::string b_key;        // B's own sealed node key
  std::string scheduler, server0, server1, worker_a;
};

// B's transport, keeping the node tables it receives (the node keys and
// addresses of the job), and sending what B seals for server r through
// relays[r] (its sealed lane's port in B's tables is the relay's).
class TableTap : public ForwardingTransport {
 public:
  TableTap(std::unique_ptr<Transport> inner, std::array<TcpTap, 2>* relays)
      : ForwardingTransport(std::move(inner)), relays_(relays) {}

  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    absl::StatusOr<Message> m = inner_->Receive(timeout);
    if (m.ok() && m->header.command() == wire::NODE_TABLE &&
        !m->header.is_response()) {
      absl::MutexLock lock(&mu_);
      table_ = m->header.node_table();
      for (wire::NodeInfo& n :
           *m->header.mutable_node_table()->mutable_nodes()) {
        if (!IsServerId(n.id()) || n.sealed_port() == 0) continue;
        TcpTap& relay = (*relays_)[RankOfId(n.id())];
        relay.SetTarget(n.sealed_port());
        n.set_sealed_port(relay.port());
      }
    }
    return m;
  }
  // The latest table's entry for node `id` (an empty one if none).
  wire::NodeInfo Find(int id) const {
    absl::MutexLock lock(&mu_);
    for (const wire::NodeInfo& n : table_.nodes()) {
      if (n.id() == id) return n;
    }
    return wire::NodeInfo();
  }

 private:
  std::array<TcpTap, 2>* const relays_;
  mutable absl::Mutex mu_;
  wire::NodeTable table_ ABSL_GUARDED_BY(mu_);  // as the scheduler sent it
};

// A restart's registration of B (its address, a later generation) claiming
// the sealed node key `key`.
Message Restart(const wire::NodeInfo& b, const std::string& key) {
  Message reg = Forged(wire::REGISTER, 0, wire::CONTROL);
  wire::Register* r = reg.header.mutable_register_();
  *r->mutable_node() = b;
  r->mutable_node()->set_generation(b.generation() + 1);
  r->mutable_node()->set_node_key(key);
  r->set_nonce(0x5eed);
  reg.header.set_generation(b.generation() + 1);
  return reg;
}

// Registrations over a main (CURVE) link of B's own key, as B restarted:
// claiming server 0's sealed node key, its bit-255 twin and p = 2^255 - 19
// (which X25519 takes as 0). Returns once the scheduler logged all three
// (10 s at most).
void ClaimKeys(ProcessCluster& c, const Options& options, const TableTap& tap,
               int b_id, Outcome* out) {
  const wire::NodeInfo b = tap.Find(b_id);
  out->b_port = b.port();
  out->claimed_key = tap.Find(ServerId(0)).node_key();
  ASSERT_EQ(b.id(), b_id);
  ASSERT_EQ(out->claimed_key.size(), 32u);
  std::string twin = out->claimed_key;
  twin[31] = static_cast<char>(twin[31] ^ 0x80);
  std::string p(32, '\xff');
  p[0] = '\xed';
  p[31] = '\x7f';
  absl::StatusOr<std::unique_ptr<Transport>> link =
      NewZmqTransportForNode(options);
  ASSERT_TRUE(link.ok()) << link.status();
  ASSERT_TRUE((*link)->Connect(kSchedulerId, "127.0.0.1", c.port()).ok());
  for (const std::string* key : {&out->claimed_key, &twin, &p})
    EXPECT_TRUE((*link)->Send(kSchedulerId, Restart(b, *key)).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto logged = [&] {
    const std::string log = ProcessCluster::Log(c.Find("scheduler"));
    size_t n = 0;
    for (size_t at = log.find("ignored a registration");
         at != std::string::npos;
         at = log.find("ignored a registration", at + 1)) {
      ++n;
    }
    return n;
  };
  while (logged() < 3 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  (*link)->Close();
}

// B's first session with each server's sealed lane, as B's ZeroMQ sent it
// (greeting, PLAIN handshake, records), written again over a connection of
// its own: every record is one the link took already. Each returns once the
// server logged its first record dropped (10 s at most).
void ReplaySessions(ProcessCluster& c, const std::array<TcpTap, 2>& relays) {
  for (int i = 0; i < 2; ++i) {
    const std::string session = relays[i].Captured();
    EXPECT_GT(session.size(), 1000u);
    auto dropped = [&c, i] {
      const std::string logs = ProcessCluster::Log(c.Find("server 0")) +
                               ProcessCluster::Log(c.Find("server 1"));
      int n = 0;
      for (size_t at = logs.find("record 0) already passed");
           at != std::string::npos;
           at = logs.find("record 0) already passed", at + 1)) {
        ++n;
      }
      return n > i;
    };
    EXPECT_TRUE(TcpTap::Replay(relays[i].target(), session, dropped));
  }
}

std::string RandomBytes(size_t n) {
  std::random_device random;
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(random());
  return out;
}

// B's transport, as NewZmqTransportForNode makes it, but sealing with the
// node key of `node_secret` (which the test keeps, to seal on B's links).
absl::StatusOr<std::unique_ptr<Transport>> RogueTransport(
    const Options& options, const std::string& node_secret) {
  ZmqTransportOptions o;
  o.max_message_bytes = options.max_frame_bytes;
  o.sealed_port = options.sealed_port;
  absl::StatusOr<std::shared_ptr<const ConnectionSecurity>> security =
      LoadConnectionSecurity(options);
  if (!security.ok()) return security.status();
  o.security = *security;
  o.metrics = &MetricsRegistry::Global();
  o.node_secret = node_secret;
  return NewZmqTransport(o);
}

// On B's link to the server whose session the relays kept whole (the one
// that took fewer of B's records), two messages sealed with B's own link
// keys, next in the link's order: a push whose header announces 8 frames of
// 1 GiB (TESSERA_MAX_MESSAGE_BYTES' bound each: 8 GiB) and no bytes, then
// one announcing a frame of 8 GiB. Sent over a connection of their own after
// the session's handshake (B's own PLAIN credentials, from the relay). Both
// are dropped as malformed (the first promises 8 GiB in a record marked
// last), before any frame's memory is taken. B's next two records on the
// link, numbered as these, are dropped as replayed.
void AnnounceEightGiB(ProcessCluster& c, const Options& options,
                      const std::string& node_secret,
                      const std::array<TcpTap, 2>& relays, TableTap& tap,
                      int b_id) {
  const int rank =
      relays[0].Captured().size() <= relays[1].Captured().size() ? 0 : 1;
  const std::string session = relays[rank].Captured();
  ASSERT_LT(session.size(), size_t{4} << 20) << "the relay kept part of it";
  size_t handshake_end = 0;
  const std::optional<sealed::Prefix> last =
      LastRecord(session, &handshake_end);
  ASSERT_TRUE(last.has_value());
  ASSERT_GT(handshake_end, 64u);
  ASSERT_EQ(last->epoch, 0u);
  // B's link keys, and the link's secret.
  absl::StatusOr<std::shared_ptr<const ConnectionSecurity>> security =
      LoadConnectionSecurity(options);
  ASSERT_TRUE(security.ok()) << security.status();
  const JobKeys& keys = (*security)->keys;
  std::array<sealed::Key32, 3> publics;
  for (Role r : {Role::kScheduler, Role::kServer, Role::kWorker})
    publics[static_cast<int>(r)] = *sealed::KeyFromZ85(keys.public_key(r));
  sealed::Key32 secret;
  std::memcpy(secret.data(), node_secret.data(), secret.size());
  const sealed::NodeKey node = sealed::NodeKey::FromSecret(secret);
  std::optional<sealed::LinkKeys> link_keys = sealed::LinkKeys::Make(
      node, Role::kWorker, *sealed::KeyFromZ85(keys.secret_key), publics,
      (*security)->job_id);
  ASSERT_TRUE(link_keys.has_value());
  const std::string server_key = tap.Find(ServerId(rank)).node_key();
  ASSERT_EQ(server_key.size(), 32u);
  sealed::Key32 peer_key;
  std::memcpy(peer_key.data(), server_key.data(), peer_key.size());
  sealed::PeerSecrets peer;
  ASSERT_TRUE(link_keys->ForPeer(peer_key, &peer));
  sealed::Sealer sealer(
      Role::kWorker, node.public_key(), last->link,
      link_keys->SendingSecret(peer, Role::kServer, peer_key, last->link));
  // Past B's records: those numbers are taken.
  Message filler = Forged(wire::KV_PULL, b_id, wire::DATA);
  const std::string filler_header = filler.header.SerializeAsString();
  Records discard;
  while (sealer.next_seq() <= last->seq) {
    ASSERT_TRUE(sealer
                    .Seal(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(
                                                  filler_header.data()),
                                              filler_header.size()),
                          {}, discard)
                    .ok());
  }
  std::string bytes = session.substr(0, handshake_end);
  for (const auto& [frames, frame_bytes] :
       {std::pair<int, uint64_t>{8, uint64_t{1} << 30},
        {1, uint64_t{1} << 33}}) {
    Message push = Forged(wire::KV_PUSH, b_id, wire::DATA);
    for (int i = 0; i < frames; ++i) {
      wire::DataFrame* f = push.header.add_frames();
      f->set_encoding(wire::DataFrame::FLOAT32);
      f->set_num_values(frame_bytes / 4);
      f->set_num_bytes(frame_bytes);
    }
    const std::string header = push.header.SerializeAsString();
    Records sealed;
    ASSERT_TRUE(sealer
                    .Seal(absl::MakeConstSpan(
                              reinterpret_cast<const uint8_t*>(header.data()),
                              header.size()),
                          {}, sealed)
                    .ok());
    for (const auto& r : sealed.records) bytes += ZmtpFrame(r);
  }
  auto dropped = [&c] {
    return (ProcessCluster::Log(c.Find("server 0")) +
            ProcessCluster::Log(c.Find("server 1")))
               .find("a frame of 8589934592 bytes") != std::string::npos;
  };
  EXPECT_TRUE(TcpTap::Replay(relays[rank].target(), bytes, dropped));
  // The two numbers are taken: B's next two records on the link are
  // dropped as replayed. Two of no consequence go first, so that B's own
  // requests need no resend.
  for (int i = 0; i < 2; ++i)
    EXPECT_TRUE(
        tap.Send(ServerId(rank), Forged(wire::KV_STATS, b_id, wire::DATA))
            .ok());
}

// The parking queue flooded: after B's handshake (its PLAIN credentials),
// 300 records of node keys no node holds, on one connection. The connection
// is admitted for B's node key alone (sealed_admission.h): every record
// claiming another is dropped as of a wrong sender, naming B's key, and
// nothing parks (before per-pair admission: 128 parked, the rest dropped as
// of an unknown key).
void FloodParking(ProcessCluster& c, const std::array<TcpTap, 2>& relays) {
  const std::string session = relays[0].Captured();
  size_t handshake_end = 0;
  (void)LastRecord(session, &handshake_end);
  ASSERT_GT(handshake_end, 64u);
  std::string bytes = session.substr(0, handshake_end);
  for (int i = 0; i < 300; ++i) {
    sealed::Prefix p;
    p.flags = sealed::kFirst | sealed::kLast;
    const std::string key = RandomBytes(32);
    std::memcpy(p.node_key.data(), key.data(), key.size());
    p.link = 1;
    p.length = 16;
    std::vector<uint8_t> record(sealed::kRecordOverhead + p.length);
    sealed::EncodePrefix(p, record.data());
    bytes += ZmtpFrame(record);
  }
  auto dropped = [&c] {
    return ProcessCluster::Log(c.Find("server 0"))
                   .find(", admitted for node key ") != std::string::npos ||
           ProcessCluster::Log(c.Find("server 1"))
                   .find(", admitted for node key ") != std::string::npos;
  };
  EXPECT_TRUE(TcpTap::Replay(relays[0].target(), bytes, dropped));
}

// B's rounds: push a gradient made of the round's number, pull both keys.
void Rounds(KVClient& b, int first, int count, Outcome* out) {
  std::vector<float> grad(kBigLen), small_grad(kSmallLen);
  for (int r = first; r < first + count; ++r) {
    for (size_t i = 0; i < kBigLen; ++i)
      grad[i] = static_cast<float>((r + 1) * (i % 5 + 1)) * 0.125f;
    for (size_t i = 0; i < kSmallLen; ++i)
      small_grad[i] = static_cast<float>(r) - 0.5f * static_cast<float>(i);
    absl::StatusOr<OpHandle> p = b.PushAsync(kBig, grad);
    ASSERT_TRUE(p.ok()) << p.status();
    {
      const absl::Status waited = b.Wait(*p);
      ASSERT_TRUE(waited.ok()) << waited;
    }
    p = b.PushAsync(kSmall, small_grad);
    ASSERT_TRUE(p.ok()) << p.status();
    {
      const absl::Status waited = b.Wait(*p);
      ASSERT_TRUE(waited.ok()) << waited;
    }
    p = b.PullAsync(kBig, absl::MakeSpan(out->big));
    ASSERT_TRUE(p.ok()) << p.status();
    {
      const absl::Status waited = b.Wait(*p);
      ASSERT_TRUE(waited.ok()) << waited;
    }
    p = b.PullAsync(kSmall, absl::MakeSpan(out->small));
    ASSERT_TRUE(p.ok()) << p.status();
    {
      const absl::Status waited = b.Wait(*p);
      ASSERT_TRUE(waited.ok()) << waited;
    }
  }
}

// Every scene, sent over B's own sealed links.
void Attack(Transport& t, int b_id, Outcome* out) {
  // A second rank, and a spare's place, by sealed registrations.
  out->rogue_port = FreePort();
  EXPECT_TRUE(
      t.Send(kSchedulerId, Registration(wire::WORKER, out->rogue_port)).ok());
  EXPECT_TRUE(
      t.Send(kSchedulerId, Registration(wire::SERVER, out->rogue_port)).ok());
  // Server-to-server messages in B's own name: a replica update and a
  // transfer (a slice, a count and an ask) to each server.
  for (int server : {ServerId(0), ServerId(1)}) {
    EXPECT_TRUE(t.Send(server, ForgedSlice(wire::KV_REPLICATE, b_id)).ok());
    EXPECT_TRUE(t.Send(server, ForgedSlice(wire::KV_TRANSFER, b_id)).ok());
    Message ask = Forged(wire::KV_TRANSFER, b_id, wire::DATA);
    EXPECT_TRUE(t.Send(server, ask).ok());
    ask.header.set_is_response(true);
    ask.header.set_transfer_total(0);
    EXPECT_TRUE(t.Send(server, ask).ok());
  }
  // A replacement's report, a hand-back's, a server's goodbye.
  EXPECT_TRUE(
      t.Send(kSchedulerId, Forged(wire::CAUGHT_UP, b_id, wire::CONTROL)).ok());
  Message handback = Forged(wire::HANDBACK, b_id, wire::CONTROL);
  handback.header.set_handback_epoch(1);
  EXPECT_TRUE(t.Send(kSchedulerId, handback).ok());
  EXPECT_TRUE(
      t.Send(kSchedulerId, Forged(wire::SERVER_LEAVE, b_id, wire::CONTROL))
          .ok());
  // A replica update in server 0's name (B's seal names B).
  EXPECT_TRUE(
      t.Send(ServerId(0), ForgedSlice(wire::KV_REPLICATE, ServerId(0))).ok());
}

Outcome RunJob(bool attack) {
  Outcome out;
  out.big.assign(kBigLen, 0.0f);
  out.small.assign(kSmallLen, 0.0f);
  ProcessCluster c;
  c.Env("DMLC_NUM_SERVER", "2");
  c.Env("DMLC_NUM_WORKER", "2");
  c.Env("TESSERA_REPLICAS", "2");
  const Roster nodes(c, {"server 0", "server 1", "worker 0", "worker 1"});
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"},
           {"TESSERA_KEY_FILE", nodes.scheduler_file()}});
  for (int s = 0; s < 2; ++s) {
    c.Spawn(absl::StrCat("server ", s), {BinaryPath("server/tessera-server")},
            {{"DMLC_ROLE", "server"}, {"TESSERA_KEY_FILE", nodes[s].file}});
  }
  c.Spawn("worker A",
          {BinaryPath("tests/core/kv_check_worker"), "barrier", "3", "100"},
          {{"DMLC_ROLE", "worker"},
           {"TESSERA_KEY_FILE", nodes[2].file},
           {"DMLC_TASK_ID", "4"}});
  const Options options = RogueOptions(c, nodes[3].file);
  const std::string node_secret = RandomBytes(32);
  absl::StatusOr<std::unique_ptr<Transport>> made =
      RogueTransport(options, node_secret);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return out;
  std::array<TcpTap, 2> relays;
  EXPECT_NE(relays[1].port(), 0);
  auto tap = std::make_unique<TableTap>(*std::move(made), &relays);
  TableTap* transport = tap.get();
  absl::StatusOr<std::unique_ptr<KVClient>> b =
      KVClient::Create(options, /*sync=*/false, std::move(tap));
  EXPECT_TRUE(b.ok()) << b.status() << c.AllLogs();
  if (!b.ok()) return out;
  KVClient& rogue = **b;
  out.b_id = WorkerId(rogue.rank());
  out.b_key = transport->node_key();
  std::vector<float> big(kBigLen), small(kSmallLen);
  for (size_t i = 0; i < kBigLen; ++i) big[i] = static_cast<float>(i % 97);
  for (size_t i = 0; i < kSmallLen; ++i) small[i] = static_cast<float>(i) + 1;
  EXPECT_EQ(rogue.rank(), 0);
  EXPECT_TRUE(rogue.SetOptimizer("sgd lr=-1").ok());
  EXPECT_TRUE(rogue.Init(kBig, big).ok());
  EXPECT_TRUE(rogue.Init(kSmall, small).ok());
  EXPECT_TRUE(rogue.Barrier().ok());
  Rounds(rogue, 0, kRounds, &out);
  if (attack) {
    Attack(*transport, out.b_id, &out);
    ClaimKeys(c, options, *transport, out.b_id, &out);
    ReplaySessions(c, relays);
    AnnounceEightGiB(c, options, node_secret, relays, *transport, out.b_id);
    FloodParking(c, relays);
  }
  EXPECT_TRUE(rogue.Barrier().ok());
  Rounds(rogue, kRounds, kRounds, &out);
  EXPECT_TRUE(rogue.Barrier().ok());
  EXPECT_TRUE(rogue.Close().ok());
  b->reset();
  ExpectAllExitZero(c, absl::Seconds(90));
  out.scheduler = ProcessCluster::Log(c.Find("scheduler"));
  out.server0 = ProcessCluster::Log(c.Find("server 0"));
  out.server1 = ProcessCluster::Log(c.Find("server 1"));
  out.worker_a = ProcessCluster::Log(c.Find("worker A"));
  return out;
}

TEST(RogueNodeTest, AWorkerWithValidKeysGetsNowhereAndTheResultIsUnchanged) {
  const Outcome clean = RunJob(/*attack=*/false);
  const Outcome rogue = RunJob(/*attack=*/true);
  ASSERT_FALSE(HasFailure());
  // The result, bit for bit, and not the initial values.
  ASSERT_EQ(clean.big.size(), rogue.big.size());
  EXPECT_EQ(std::memcmp(clean.big.data(), rogue.big.data(), kBigLen * 4), 0);
  EXPECT_EQ(std::memcmp(clean.small.data(), rogue.small.data(), kSmallLen * 4),
            0);
  EXPECT_NE(clean.big[1], 1.0f);
  // The servers applied the same pushes and replica updates as in the clean
  // run (which process took which rank may differ between the two runs).
  auto counts = [](const Outcome& o) {
    std::vector<std::pair<int64_t, int64_t>> c;
    for (const std::string* log : {&o.server0, &o.server1}) {
      c.emplace_back(SummaryCount(*log, "pushes applied"),
                     SummaryCount(*log, "replica updates"));
    }
    std::sort(c.begin(), c.end());
    return c;
  };
  EXPECT_EQ(counts(rogue), counts(clean));
  EXPECT_GT(counts(clean)[1].first, 0);
  const std::string by =
      absl::StrCat(" (sealed by worker id ", rogue.b_id, ")");
  const std::string servers = rogue.server0 + rogue.server1;
  // Registrations for a second rank and a spare's place: dropped, naming B.
  EXPECT_THAT(rogue.scheduler,
              HasSubstr(absl::StrCat("it claims sender 0, but it was sealed "
                                     "with the node key of worker id ",
                                     rogue.b_id, ": REGISTER")));
  EXPECT_THAT(rogue.scheduler,
              HasSubstr("it registers as SERVER, but it came with the worker "
                        "key" +
                        by));
  EXPECT_THAT(rogue.scheduler, Not(HasSubstr("joins the job")));
  EXPECT_THAT(rogue.scheduler,
              Not(HasSubstr(absl::StrCat(":", rogue.rogue_port))));
  // A server's reports and goodbye.
  for (const char* command : {"CAUGHT_UP", "HANDBACK", "SERVER_LEAVE"}) {
    EXPECT_THAT(rogue.scheduler,
                HasSubstr(absl::StrCat(command,
                                       " is a server's message, but "
                                       "it came with the worker key",
                                       by)));
  }
  EXPECT_THAT(rogue.scheduler, Not(HasSubstr("caught up")));
  EXPECT_THAT(rogue.scheduler, Not(HasSubstr("left the job")));
  // Replica updates and transfers, in B's name at each server, and one in
  // server 0's name.
  for (const std::string& server : {rogue.server0, rogue.server1}) {
    EXPECT_THAT(server, HasSubstr("KV_REPLICATE is a server's message, but it "
                                  "came with the worker key" +
                                  by));
    EXPECT_THAT(server, HasSubstr("KV_TRANSFER is a server's message, but it "
                                  "came with the worker key" +
                                  by));
  }
  EXPECT_THAT(servers, HasSubstr("it claims sender 8 (a server), but it came "
                                 "with the worker key" +
                                 by));
  // Counted: 4 at one server, 5 at the other (the update in server 0's
  // name), and the flood's 300 records (below); none malformed; 5 at the
  // scheduler.
  EXPECT_EQ(SummaryCount(rogue.server0, "wrong sender") +
                SummaryCount(rogue.server1, "wrong sender"),
            9 + 300)
      << servers;
  EXPECT_EQ(SummaryCount(rogue.server0, "malformed") +
                SummaryCount(rogue.server1, "malformed"),
            0)
      << servers;
  EXPECT_THAT(rogue.scheduler, HasSubstr("dropped sealed record #5:"));
  EXPECT_THAT(rogue.scheduler, Not(HasSubstr("dropped sealed record #6:")));
  EXPECT_THAT(rogue.worker_a, HasSubstr("barrier ok: rank 1, 3 barriers"));
  // B's restarts over its own CURVE link: server 0's sealed node key, its
  // bit-255 twin, p. Each refused, counted and named; B is not restarted
  // and server 0 keeps its place (the results above).
  EXPECT_EQ(SummaryCount(clean.scheduler, "ignored messages"), 0)
      << clean.scheduler;
  EXPECT_EQ(SummaryCount(rogue.scheduler, "ignored messages"), 3)
      << rogue.scheduler;
  const std::string claimed = absl::BytesToHexString(rogue.claimed_key);
  EXPECT_THAT(rogue.scheduler,
              HasSubstr(absl::StrCat("ignored a registration as worker 0 (id ",
                                     rogue.b_id, " at 127.0.0.1:", rogue.b_port,
                                     ") (generation 1): its sealed node key ",
                                     claimed.substr(0, 12),
                                     "... is server 0 (id ", ServerId(0))));
  const std::string at = absl::StrCat(
      "ignored a registration of the node at 127.0.0.1:", rogue.b_port,
      ", worker 0 (id ", rogue.b_id, " at 127.0.0.1:", rogue.b_port,
      ")'s address: its sealed node key ");
  EXPECT_THAT(rogue.scheduler,
              HasSubstr(at + claimed.substr(0, 12) +
                        "... cannot be a node key: its bit 255 is set"));
  EXPECT_THAT(rogue.scheduler,
              HasSubstr(at + "edffffffffff... cannot be a node key: it is "
                             "not below 2^255 - 19"));
  EXPECT_THAT(rogue.scheduler, Not(HasSubstr(" restarted (generation")));
  // B's first sessions with the servers replayed: every record dropped as
  // replayed, naming B, none taken (the results above), none malformed.
  auto replayed = [](const Outcome& o) {
    return std::max<int64_t>(0, SummaryCount(o.server0, "replayed")) +
           std::max<int64_t>(0, SummaryCount(o.server1, "replayed"));
  };
  EXPECT_EQ(replayed(clean), 0);
  EXPECT_GT(replayed(rogue), 0) << servers;
  EXPECT_THAT(servers, HasSubstr(absl::StrCat("a record from worker id ",
                                              rogue.b_id, " (link ")));
  EXPECT_THAT(servers, HasSubstr(") already passed: the link is at link "));
  // 8 GiB announced on B's link, next in its order: both dropped as
  // malformed before any frame's memory is taken, naming B; B's records
  // numbered as they were dropped as replayed (above) and went again.
  auto sealed_malformed = [](const Outcome& o) {
    const char* name = "sealed drops \\d+ \\(malformed";
    return std::max<int64_t>(0, SummaryCount(o.server0, name)) +
           std::max<int64_t>(0, SummaryCount(o.server1, name));
  };
  EXPECT_EQ(sealed_malformed(clean), 0);
  EXPECT_EQ(sealed_malformed(rogue), 2) << servers;
  const std::string from =
      absl::StrCat("a message from worker id ", rogue.b_id);
  EXPECT_THAT(servers, HasSubstr(from + ": its header describes 8589934592 "
                                        "bytes of data; the first record "
                                        "holds 0 and is the last"));
  EXPECT_THAT(servers, HasSubstr(from + ": a frame of 8589934592 bytes; this "
                                        "node takes at most 1073741824"));
  for (const std::string* log : {&rogue.server0, &rogue.server1})
    EXPECT_LT(SummaryCount(*log, "peak RSS"), 200) << *log;
  // The parking queue: none of the flood's 300 records parks; each is
  // dropped at the connection admitted for B's key, which the line names.
  auto unknown = [](const Outcome& o) {
    return std::max<int64_t>(0, SummaryCount(o.server0, "unknown key")) +
           std::max<int64_t>(0, SummaryCount(o.server1, "unknown key"));
  };
  EXPECT_EQ(unknown(clean), 0);
  EXPECT_EQ(unknown(rogue), 0) << servers;
  ASSERT_EQ(rogue.b_key.size(), 32u);
  sealed::Key32 b_key;
  std::memcpy(b_key.data(), rogue.b_key.data(), b_key.size());
  EXPECT_THAT(servers, HasSubstr(", admitted for node key " +
                                 sealed::Z85Key(b_key).substr(0, 8) + "..."));
}

}  // namespace
}  // namespace tessera::testing
