// Admission to a sealed lane (issue #46; common/sealed_admission.h), against
// a real server transport: only a password of the connecting process's own
// pair with the server is taken (not another pair's, not the role pair's of
// before, not another process's key with one's own password); a connection
// whose key the server learns 300 ms later waits for it instead of being
// refused; an admitted connection carries only its own node key's records;
// records that fail to open throttle their connection, not the others; and
// no one source address can spend the scheduler claims' checks or the held
// answers' slots of everyone.
//
// The test plays the connecting processes itself, with node keys of its own,
// and derives their passwords from the design (the KDF below), not from the
// code under test.
#include "common/sealed_admission.h"

#include <sodium.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/curve_keys.h"
#include "common/message.h"
#include "common/sealed_link.h"
#include "common/transport.h"
#include "common/zap_handler.h"
#include "common/zap_hold_queue.h"
#include "gtest/gtest.h"
#include "tests/support/sealed_session.h"

namespace tessera::sealed {
namespace {

constexpr int kServer = 8;
constexpr char kLabel[] = "tessera sealed lane admission v1";

std::string Z85(const Key32& key) {
  char text[41];
  zmq_z85_encode(text, key.data(), key.size());
  return std::string(text, 40);
}

Key32 Random() {
  Key32 k;
  randombytes_buf(k.data(), k.size());
  return k;
}

Key32 X25519(const Key32& secret, const Key32& point) {
  Key32 out;
  EXPECT_EQ(crypto_scalarmult(out.data(), secret.data(), point.data()), 0);
  return out;
}

// A process the test plays: a node key whose secret it holds, and its
// role's secret key.
struct Process {
  Process(const JobKeySet& job, Role r, int node_id)
      : role(r),
        id(node_id),
        secret(Random()),
        node(NodeKey::FromSecret(secret)),
        role_secret(*KeyFromZ85(job.of(r).secret_key)) {
    std::array<Key32, 3> publics;
    for (Role x : {Role::kScheduler, Role::kServer, Role::kWorker})
      publics[static_cast<int>(x)] = *KeyFromZ85(job.of(x).public_key);
    keys = std::make_shared<const LinkKeys>(
        *LinkKeys::Make(node, role, role_secret, publics));
  }
  const Key32& key() const { return node.public_key(); }
  std::string User() const {
    return absl::StrCat(RoleName(role), ":", Z85(key()));
  }
  // The pair's admission password toward `to` (the design's KDF).
  std::string PasswordTo(const Key32& to, Role to_role) const {
    const Key32 ee = X25519(secret, to), se = X25519(role_secret, to);
    crypto_generichash_state st;
    crypto_generichash_init(&st, nullptr, 0, 32);
    crypto_generichash_update(&st, reinterpret_cast<const uint8_t*>(kLabel),
                              sizeof(kLabel) - 1);
    crypto_generichash_update(&st, ee.data(), 32);
    crypto_generichash_update(&st, se.data(), 32);
    const uint8_t from = static_cast<uint8_t>(role),
                  dest = static_cast<uint8_t>(to_role);
    crypto_generichash_update(&st, &from, 1);
    crypto_generichash_update(&st, key().data(), 32);
    crypto_generichash_update(&st, &dest, 1);
    crypto_generichash_update(&st, to.data(), 32);
    const uint8_t no_job_id[4] = {0, 0, 0, 0};
    crypto_generichash_update(&st, no_job_id, 4);
    Key32 out;
    crypto_generichash_final(&st, out.data(), 32);
    return Z85(out);
  }
  // A push's records, sealed on link `link` to `to`.
  std::vector<std::vector<uint8_t>> Seal(const Key32& to, uint64_t request,
                                         uint32_t link = 1) const {
    PeerSecrets p;
    EXPECT_TRUE(keys->ForPeer(to, &p));
    Sealer sealer(role, key(), link,
                  keys->SendingSecret(p, Role::kServer, to, link));
    Message m;
    m.header.set_command(wire::KV_PUSH);
    m.header.set_sender(id);
    m.header.set_recipient(kServer);
    m.header.set_request_id(request);
    m.header.set_plane(wire::DATA);
    m.header.mutable_slice()->set_key(7);
    const float values[4] = {1, 2, 3, 4};
    AddFloatFrame(&m, Buffer::CopyOf(values, sizeof(values)));
    const std::string header = m.header.SerializeAsString();
    testing::Records sink;
    EXPECT_TRUE(sealer
                    .Seal(absl::Span<const uint8_t>(
                              reinterpret_cast<const uint8_t*>(header.data()),
                              header.size()),
                          m.data, sink)
                    .ok());
    return sink.records;
  }

  Role role;
  int id;
  Key32 secret;
  NodeKey node;
  Key32 role_secret;
  std::shared_ptr<const LinkKeys> keys;
};

// A server's transport with its sealed lane, and raw client sockets to it.
class AdmissionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto security = std::make_shared<ConnectionSecurity>();
    security->keys = *ParseKeyFile(FormatKeyFile(job_, Role::kServer), "test");
    ZmqTransportOptions o;
    o.security = security;
    o.scheduler_address = scheduler_address_;
    server_ = NewZmqTransport(o);
    ASSERT_TRUE(server_->Bind("127.0.0.1", 0).ok());
    const std::string k = server_->node_key();
    ASSERT_EQ(k.size(), 32u);
    std::memcpy(server_key_.data(), k.data(), 32);
    context_ = zmq_ctx_new();
  }
  void TearDown() override {
    for (auto& [socket, monitor] : monitors_) zmq_close(monitor);
    for (void* s : sockets_) zmq_close(s);
    zmq_ctx_term(context_);
    server_->Close();
  }
  void Know(const Process& p) {
    PeerIdentity identity;
    identity.role = p.role;
    identity.node_key =
        std::string(reinterpret_cast<const char*>(p.key().data()), 32);
    identity.sealed_port = 1;
    server_->SetPeerIdentity(p.id, identity);
  }
  // To the server's sealed lane, or to `port` of 127.0.0.1; from `source`
  // (an address of this host, e.g. "127.0.0.2") when one is given.
  void* Connect(const std::string& user, const std::string& password,
                const std::string& source = "", int port = 0) {
    void* s = zmq_socket(context_, ZMQ_PUSH);
    const int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    // A refused connection's pipe goes: a send after that would wait for
    // ever (a PUSH socket with no peer), so sends wait at most 500 ms.
    const int send_ms = 500;
    zmq_setsockopt(s, ZMQ_SNDTIMEO, &send_ms, sizeof(send_ms));
    zmq_setsockopt(s, ZMQ_PLAIN_USERNAME, user.data(), user.size());
    zmq_setsockopt(s, ZMQ_PLAIN_PASSWORD, password.data(), password.size());
    // Its handshakes' outcomes, watched (Outcome).
    const std::string monitor = absl::StrCat("inproc://monitor-", ++made_);
    EXPECT_EQ(zmq_socket_monitor(s, monitor.c_str(),
                                 ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                                     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH),
              0);
    void* m = zmq_socket(context_, ZMQ_PAIR);
    EXPECT_EQ(zmq_connect(m, monitor.c_str()), 0);
    monitors_[s] = m;
    const std::string endpoint =
        absl::StrCat("tcp://", source.empty() ? "" : source + ":0;",
                     "127.0.0.1:", port != 0 ? port : server_->sealed_port());
    EXPECT_EQ(zmq_connect(s, endpoint.c_str()), 0);
    sockets_.push_back(s);
    return s;
  }
  // Sends `records` on `s`; stops, as a refused connection does, when one
  // cannot be queued within the send time-out (the refusal took the pipe
  // first). Whether they arrived is for Received and Outcome to say.
  static void Send(void* s, const std::vector<std::vector<uint8_t>>& records) {
    for (const auto& r : records) {
      const int sent = zmq_send(s, r.data(), r.size(), 0);
      if (sent < 0 && zmq_errno() == EAGAIN) return;
      EXPECT_EQ(sent, static_cast<int>(r.size()));
    }
  }
  // `p` connects and sends a sealed push (`*s` its socket) before the server
  // knows its key; the server learns the key 300 ms later and must take the
  // push within 1 s.
  void SendThenLearnKey(const Process& p, void** s) {
    *s = Connect(p.User(), p.PasswordTo(server_key_, Role::kServer));
    Send(*s, p.Seal(server_key_, 1));
    absl::SleepFor(absl::Milliseconds(300));
    Know(p);
    absl::StatusOr<Message> m = server_->Receive(absl::Seconds(1));
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->header.sender(), p.id);
  }
  // The messages the server takes within `wait`.
  std::vector<Message> Received(absl::Duration wait) {
    std::vector<Message> got;
    const absl::Time until = absl::Now() + wait;
    while (absl::Now() < until) {
      absl::StatusOr<Message> m = server_->Receive(until - absl::Now());
      if (m.ok()) got.push_back(*std::move(m));
    }
    return got;
  }
  // The first handshake outcome of `s` within `wait`: "admitted",
  // "refused" or "none".
  std::string Outcome(void* s, absl::Duration wait) {
    void* m = monitors_.at(s);
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(wait));
    zmq_setsockopt(m, ZMQ_RCVTIMEO, &ms, sizeof(ms));
    zmq_msg_t event;
    zmq_msg_init(&event);
    if (zmq_msg_recv(&event, m, 0) < 0) {
      zmq_msg_close(&event);
      return "none";
    }
    uint16_t what = 0;
    std::memcpy(&what, zmq_msg_data(&event), sizeof(what));
    zmq_msg_close(&event);
    zmq_msg_t address;  // the event's second frame
    zmq_msg_init(&address);
    zmq_msg_recv(&address, m, 0);
    zmq_msg_close(&address);
    return what == ZMQ_EVENT_HANDSHAKE_SUCCEEDED ? "admitted" : "refused";
  }

  // The server's configured scheduler address (DMLC_PS_ROOT_URI's), if any;
  // set before SetUp.
  std::string scheduler_address_;
  JobKeySet job_ = GenerateJobKeys().value();
  std::unique_ptr<Transport> server_;
  Key32 server_key_{};
  void* context_ = nullptr;
  std::vector<void*> sockets_;
  std::map<void*, void*> monitors_;  // each socket's monitor's end
  int made_ = 0;
};

// Worker A's own password is taken; A's password for another server, the
// workers' role password of before, worker C's key with A's password, and a
// made-up key claiming the scheduler's role are refused, and the records
// sent over them (A's, which the server could open) go nowhere.
TEST_F(AdmissionTest, OnlyThePairsOwnPasswordIsAdmitted) {
  const Process a(job_, Role::kWorker, 9), c(job_, Role::kWorker, 11);
  Know(a);
  Know(c);
  const std::string to_server = a.PasswordTo(server_key_, Role::kServer);
  // Each sends A's records on a new link (a fresh key): opened, were it let
  // in.
  const Key32 other_server = NodeKey::Generate().public_key();
  const JobKeys worker = *ParseKeyFile(FormatKeyFile(job_, Role::kWorker), "t");
  const std::pair<std::string, std::string> wrong[] = {
      {a.User(), a.PasswordTo(other_server, Role::kServer)},
      {"worker", PlainPassword(worker, Role::kServer)},  // the role pair's
      {c.User(), to_server},
      {absl::StrCat("scheduler:", Z85(NodeKey::Generate().public_key())),
       to_server}};
  uint32_t link = 1;
  for (const auto& [user, password] : wrong) {
    void* s = Connect(user, password);
    Send(s, a.Seal(server_key_, link, link));
    EXPECT_EQ(Outcome(s, absl::Seconds(2)), "refused") << user;
    ++link;
  }
  EXPECT_GE(server_->refused_connection_count(), 4u);
  EXPECT_TRUE(Received(absl::Milliseconds(500)).empty());

  // A's own: admitted, its message taken.
  void* own = Connect(a.User(), to_server);
  Send(own, a.Seal(server_key_, link, link));
  EXPECT_EQ(Outcome(own, absl::Seconds(2)), "admitted");
  std::vector<Message> got = Received(absl::Seconds(1));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].header.request_id(), link);
}

// A connection whose key is in no table is held, then refused after 10 s;
// nothing it sends is taken.
TEST_F(AdmissionTest, AMadeUpNodeKeyWaitsAndIsRefused) {
  const Process a(job_, Role::kWorker, 9), stranger(job_, Role::kWorker, 13);
  Know(a);
  void* s =
      Connect(stranger.User(), stranger.PasswordTo(server_key_, Role::kServer));
  Send(s, a.Seal(server_key_, 1));
  EXPECT_EQ(Outcome(s, absl::Seconds(2)), "none");  // held
  EXPECT_TRUE(Received(absl::Milliseconds(100)).empty());
  EXPECT_EQ(server_->refused_connection_count(), 0u);
  EXPECT_EQ(Outcome(s, absl::Seconds(10)), "refused");
  EXPECT_GE(server_->refused_connection_count(), 1u);
  EXPECT_TRUE(Received(absl::Milliseconds(300)).empty());
}

// The server learns D's key 300 ms after D connected: D's connection is
// admitted then, without a refusal and ZeroMQ's reconnection.
TEST_F(AdmissionTest, AKeyKnown300MsLaterIsAdmittedWithoutAReconnect) {
  const Process d(job_, Role::kWorker, 9);
  const absl::Time start = absl::Now();
  void* s = nullptr;
  ASSERT_NO_FATAL_FAILURE(SendThenLearnKey(d, &s));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1300));
  // Its first handshake was the one admitted: no refusal, no reconnection.
  EXPECT_EQ(Outcome(s, absl::Milliseconds(100)), "admitted");
  EXPECT_EQ(server_->refused_connection_count(), 0u);
}

// The scheduler's key comes to a node after the scheduler's first message:
// a scheduler claim with an unknown key is admitted at once when its
// password's role-key term checks out; from then on the scheduler is that
// key, and another key claiming the role (a second scheduler, holding the
// role key) is refused.
TEST_F(AdmissionTest, TheSchedulerIsAdmittedBeforeItsKeyIsKnown) {
  const Process scheduler(job_, Role::kScheduler, 1),
      other(job_, Role::kScheduler, 1);
  void* s = Connect(scheduler.User(),
                    scheduler.PasswordTo(server_key_, Role::kServer));
  EXPECT_EQ(Outcome(s, absl::Seconds(2)), "admitted");
  void* t = Connect(other.User(), other.PasswordTo(server_key_, Role::kServer));
  EXPECT_EQ(Outcome(t, absl::Seconds(2)), "refused");
}

// Claims of the scheduler's role with made-up keys and wrong passwords, from
// `source`, a new connection every 2 ms (a refused one does not come back),
// until the flood is destroyed; each closed 100 ms after it was opened.
class SchedulerClaimFlood {
 public:
  SchedulerClaimFlood(void* context, int port, const std::string& source)
      : SchedulerClaimFlood(context, port, std::vector<std::string>{source},
                            absl::Milliseconds(2)) {}
  // From each of `sources` in turn, a new connection every `every`.
  SchedulerClaimFlood(void* context, int port, std::vector<std::string> sources,
                      absl::Duration every)
      : thread_([this, context, port, sources = std::move(sources), every] {
          Run(context, port, sources, every);
        }) {}
  ~SchedulerClaimFlood() {
    stop_.store(true);
    thread_.join();
  }

 private:
  void Run(void* context, int port, const std::vector<std::string>& sources,
           absl::Duration every) {
    std::deque<std::pair<void*, absl::Time>> open;
    for (size_t i = 0; !stop_.load(); ++i) {
      const std::string endpoint = absl::StrCat(
          "tcp://", sources[i % sources.size()], ":0;127.0.0.1:", port);
      void* s = zmq_socket(context, ZMQ_PUSH);
      const int linger = 0;
      zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
      const std::string user =
          absl::StrCat("scheduler:", Z85(NodeKey::Generate().public_key()));
      const std::string password = Z85(Random());
      zmq_setsockopt(s, ZMQ_PLAIN_USERNAME, user.data(), user.size());
      zmq_setsockopt(s, ZMQ_PLAIN_PASSWORD, password.data(), password.size());
      zmq_connect(s, endpoint.c_str());
      open.emplace_back(s, absl::Now());
      while (!open.empty() &&
             absl::Now() - open.front().second > absl::Milliseconds(100)) {
        zmq_close(open.front().first);
        open.pop_front();
      }
      absl::SleepFor(every);
    }
    for (auto& [s, opened] : open) zmq_close(s);
  }

  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Before the scheduler's key is known, a claim of its role costs an X25519
// to check. A flood of such claims from 127.0.0.2 (made-up keys, wrong
// passwords) spends its address's 4 checks a second, not everyone's budget:
// the real scheduler's claim, from 127.0.0.1 during the flood, is admitted
// on its first handshake. (With one budget for all, the flood spent it and
// the claim was refused.)
TEST_F(AdmissionTest,
       BadSchedulerClaimsFromOneAddressDoNotKeepTheSchedulerOut) {
  SchedulerClaimFlood flood(context_, server_->sealed_port(), "127.0.0.2");
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (server_->refused_connection_count() < 50 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(10));
  ASSERT_GE(server_->refused_connection_count(), 50u);
  const Process scheduler(job_, Role::kScheduler, 1);
  void* s = Connect(scheduler.User(),
                    scheduler.PasswordTo(server_key_, Role::kServer));
  EXPECT_EQ(Outcome(s, absl::Seconds(2)), "admitted");
}

// The server knows the scheduler's address (a node's DMLC_PS_ROOT_URI).
class AdmissionWithSchedulerAddressTest : public AdmissionTest {
 protected:
  AdmissionWithSchedulerAddressTest() { scheduler_address_ = "127.0.0.1"; }
};

// A flood of bad scheduler claims from 32 addresses (127.0.0.2 to
// 127.0.0.33, a connection every 1 ms) spends the ceiling of 64 failed
// checks a second within its first ~70 ms; the real scheduler's claim, from
// the configured scheduler address 127.0.0.1, has a budget of its own and is
// admitted on its first handshake. (Before, it shared the spent ceiling and
// was refused unchecked, unless it came in a second's first ~70 ms.)
TEST_F(AdmissionWithSchedulerAddressTest,
       BadSchedulerClaimsFromManyAddressesDoNotKeepTheSchedulerOut) {
  std::vector<std::string> sources;
  for (int i = 2; i < 34; ++i) sources.push_back(absl::StrCat("127.0.0.", i));
  SchedulerClaimFlood flood(context_, server_->sealed_port(), sources,
                            absl::Milliseconds(1));
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (server_->refused_connection_count() < 200 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(10));
  ASSERT_GE(server_->refused_connection_count(), 200u);
  const Process scheduler(job_, Role::kScheduler, 1);
  void* s = Connect(scheduler.User(),
                    scheduler.PasswordTo(server_key_, Role::kServer));
  EXPECT_EQ(Outcome(s, absl::Seconds(2)), "admitted");
}

// 70 connections from 127.0.0.2 claiming made-up worker keys: 64 are held
// (the most one address may hold), the other 6 refused at once; a worker
// from 127.0.0.1 whose key the server learns 300 ms later is still held
// and admitted. (Before, all 70 were held and none refused.)
TEST_F(AdmissionTest, OneAddressHoldsAtMost64Answers) {
  for (int i = 0; i < 70; ++i) {
    const Process stranger(job_, Role::kWorker, 13);
    Connect(stranger.User(), stranger.PasswordTo(server_key_, Role::kServer),
            "127.0.0.2");
  }
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (server_->refused_connection_count() < 6 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(300));  // the last of them too
  EXPECT_EQ(server_->refused_connection_count(), 6u);
  const Process d(job_, Role::kWorker, 9);
  void* s = nullptr;
  ASSERT_NO_FATAL_FAILURE(SendThenLearnKey(d, &s));
  EXPECT_EQ(Outcome(s, absl::Milliseconds(100)), "admitted");
  EXPECT_EQ(server_->refused_connection_count(), 6u);
}

// A ZAP handler of the test's own, with room for 8 held answers: 8
// connections from 127.0.0.2 with made-up keys fill it; a worker from
// 127.0.0.1 whose key is not known yet takes the slot of 127.0.0.2's newest
// (refused) and is admitted once the key is known. (Before, a full queue
// refused the newcomer.)
class HeldSlotsTest : public AdmissionTest {
 protected:
  void SetUp() override {
    AdmissionTest::SetUp();
    auto security = std::make_shared<ConnectionSecurity>();
    security->keys = *ParseKeyFile(FormatKeyFile(job_, Role::kServer), "test");
    admission_ = std::make_shared<Admission>(own_.keys);
    zap_ = *ZapHandler::Start(context_, security, admission_, absl::Seconds(10),
                              ZapHoldQueue::Limits{8, 64});
    receiver_ = zmq_socket(context_, ZMQ_PULL);
    const int one = 1, linger = 0;
    zmq_setsockopt(receiver_, ZMQ_PLAIN_SERVER, &one, sizeof(one));
    zmq_setsockopt(receiver_, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(receiver_, ZMQ_ZAP_DOMAIN, ZapHandler::kSealedDomain,
                   std::strlen(ZapHandler::kSealedDomain));
    ASSERT_EQ(zmq_bind(receiver_, "tcp://127.0.0.1:*"), 0);
    char endpoint[64];
    size_t size = sizeof(endpoint);
    zmq_getsockopt(receiver_, ZMQ_LAST_ENDPOINT, endpoint, &size);
    port_ = std::atoi(std::strrchr(endpoint, ':') + 1);
  }
  void TearDown() override {
    zmq_close(receiver_);
    zap_->Stop();
    AdmissionTest::TearDown();
  }

  const Process own_{job_, Role::kServer, kServer};
  std::shared_ptr<Admission> admission_;
  std::unique_ptr<ZapHandler> zap_;
  void* receiver_ = nullptr;
  int port_ = 0;
};

TEST_F(HeldSlotsTest, AFullQueueGivesTheNewestSlotOfTheBiggestHolderAway) {
  std::vector<void*> flood;
  for (int i = 0; i < 8; ++i) {
    const Process stranger(job_, Role::kWorker, 13);
    flood.push_back(Connect(stranger.User(),
                            stranger.PasswordTo(own_.key(), Role::kServer),
                            "127.0.0.2", port_));
  }
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (zap_->waiting_count() < 8 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(zap_->waiting_count(), 8u);
  const Process d(job_, Role::kWorker, 9);
  void* s =
      Connect(d.User(), d.PasswordTo(own_.key(), Role::kServer), "", port_);
  EXPECT_EQ(Outcome(s, absl::Milliseconds(500)), "none");  // held
  EXPECT_EQ(zap_->refused_count(), 1u);                    // one of 127.0.0.2's
  EXPECT_EQ(zap_->waiting_count(), 8u);
  admission_->SetPeer(9, Role::kWorker, d.key());
  EXPECT_EQ(Outcome(s, absl::Seconds(1)), "admitted");
  EXPECT_EQ(zap_->waiting_count(), 7u);
  int refused = 0;
  for (void* f : flood)
    refused += Outcome(f, absl::Milliseconds(10)) == "refused";
  EXPECT_EQ(refused, 1);
}

// A change of the node table decides again only the held requests whose key
// it added: 3 connections wait for their keys; 20 other keys, added 15 ms
// apart (each seen by a look of its own), decide none of them again; adding
// the second one's key decides that one alone, and admits it. (Before,
// every change decided all the held requests again: 60 for the 20.)
TEST_F(HeldSlotsTest, ATableChangeRedecidesOnlyTheRequestsOfTheKeysItAdded) {
  std::vector<Process> late;
  std::vector<void*> sockets;
  for (int i = 0; i < 3; ++i) {
    late.emplace_back(job_, Role::kWorker, 20 + i);
    sockets.push_back(Connect(late[i].User(),
                              late[i].PasswordTo(own_.key(), Role::kServer), "",
                              port_));
  }
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (zap_->waiting_count() < 3 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(zap_->waiting_count(), 3u);
  for (int i = 0; i < 20; ++i) {
    admission_->SetPeer(100 + i, Role::kWorker,
                        NodeKey::Generate().public_key());
    absl::SleepFor(absl::Milliseconds(15));
  }
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(zap_->rechecked_count(), 0u);
  EXPECT_EQ(zap_->waiting_count(), 3u);
  admission_->SetPeer(21, Role::kWorker, late[1].key());
  EXPECT_EQ(Outcome(sockets[1], absl::Seconds(1)), "admitted");
  EXPECT_EQ(zap_->rechecked_count(), 1u);
  EXPECT_EQ(zap_->waiting_count(), 2u);
  EXPECT_EQ(Outcome(sockets[0], absl::Milliseconds(100)), "none");
  EXPECT_EQ(Outcome(sockets[2], absl::Milliseconds(100)), "none");
}

// An admitted connection is one process's: a record of another node key on
// it (C's, which the server could open) is dropped and counted.
TEST_F(AdmissionTest, ARecordOfAnotherKeyOnAConnectionIsDropped) {
  const Process a(job_, Role::kWorker, 9), c(job_, Role::kWorker, 11);
  Know(a);
  Know(c);
  void* s = Connect(a.User(), a.PasswordTo(server_key_, Role::kServer));
  Send(s, c.Seal(server_key_, 1));
  Send(s, a.Seal(server_key_, 2));
  std::vector<Message> got = Received(absl::Seconds(1));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].header.sender(), 9);
  EXPECT_EQ(server_->sealed_drops().wrong_sender, 1u);
}

// `n` records that claim new links of `p`'s and fail to open (random bytes
// under a real prefix): each costs the receiver a key set-up to try.
std::vector<std::vector<uint8_t>> RecordsThatFailToOpen(const Process& p,
                                                        uint32_t n) {
  std::vector<std::vector<uint8_t>> records;
  for (uint32_t i = 0; i < n; ++i) {
    Prefix prefix;
    prefix.flags = kFirst | kLast;
    prefix.role = p.role;
    prefix.node_key = p.key();
    prefix.link = 100 + i;  // each a new link: a key set-up to try it
    prefix.length = 64;
    std::vector<uint8_t> r(kRecordOverhead + 64);
    randombytes_buf(r.data(), r.size());
    EncodePrefix(prefix, r.data());
    records.push_back(std::move(r));
  }
  return records;
}

// 40 records that claim new links of A's and fail to open: after 8 of them
// A's connection is throttled (the rest dropped unread), while C's real
// records, on their own connection, still open.
TEST_F(AdmissionTest, FailedOpensThrottleTheirConnectionOnly) {
  const Process a(job_, Role::kWorker, 9), c(job_, Role::kWorker, 11);
  Know(a);
  Know(c);
  void* junk = Connect(a.User(), a.PasswordTo(server_key_, Role::kServer));
  Send(junk, RecordsThatFailToOpen(a, 40));
  absl::SleepFor(absl::Milliseconds(200));
  Send(Connect(c.User(), c.PasswordTo(server_key_, Role::kServer)),
       c.Seal(server_key_, 1));
  std::vector<Message> got = Received(absl::Seconds(1));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].header.sender(), 11);
  const SealedDrops d = server_->sealed_drops();
  EXPECT_EQ(d.unauthentic, 8u);
  EXPECT_EQ(d.total(), 40u);
}

// Why strikes are kept by connection, not by node key: whoever read A's
// pair password off the wire (PLAIN sends it in the clear) is admitted as
// A on a second connection. Its 40 records that fail to open throttle that
// connection only; A's own connection, admitted before, still delivers.
// (Keyed by node key, none was received: A's record was dropped unread.)
TEST_F(AdmissionTest, AStolenPasswordsConnectionDoesNotThrottleTheRealPeer) {
  const Process a(job_, Role::kWorker, 9);
  Know(a);
  const std::string password = a.PasswordTo(server_key_, Role::kServer);
  void* real = Connect(a.User(), password);
  ASSERT_EQ(Outcome(real, absl::Seconds(2)), "admitted");
  void* thief = Connect(a.User(), password);
  ASSERT_EQ(Outcome(thief, absl::Seconds(2)), "admitted");
  Send(thief, RecordsThatFailToOpen(a, 40));
  // All 40 taken (and struck) before A sends.
  EXPECT_TRUE(Received(absl::Milliseconds(500)).empty());
  SealedDrops d = server_->sealed_drops();
  EXPECT_EQ(d.unauthentic, 8u);
  EXPECT_EQ(d.throttled, 32u);
  Send(real, a.Seal(server_key_, 1));
  std::vector<Message> got = Received(absl::Seconds(1));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].header.sender(), 9);
  EXPECT_EQ(got[0].header.request_id(), 1u);
  d = server_->sealed_drops();
  EXPECT_EQ(d.throttled, 32u);
  EXPECT_EQ(d.total(), 40u);
}

// A server's Admission, the real scheduler, and an attacker claiming the
// scheduler's role with a made-up key.
class SchedulerClaimLimitTest : public ::testing::Test {
 protected:
  const JobKeySet job_ = GenerateJobKeys().value();
  const Process server_{job_, Role::kServer, kServer};
  const Process scheduler_{job_, Role::kScheduler, 1};
  Admission admission_{server_.keys};
  const std::string attacker_ =
      absl::StrCat("scheduler:", Z85(NodeKey::Generate().public_key()));
};

// Failed scheduler checks, by address, on the admission itself: 100 bad
// claims from one address cost 4 checks (the others refused unchecked,
// naming the address), and the real scheduler's claim from another address
// is checked and admitted. (With one budget for all, 16 were checked and
// the scheduler refused.)
TEST_F(SchedulerClaimLimitTest, OneAddressSpendsOnlyItsOwnChecks) {
  int checked = 0, unchecked = 0;
  for (int i = 0; i < 100; ++i) {
    std::string user_id, why;
    ASSERT_EQ(
        admission_.Check(attacker_, Z85(Random()), "10.0.0.66", &user_id, &why),
        Admission::Verdict::kRefuse);
    if (why.find("with a password not its pair's") != std::string::npos)
      ++checked;
    if (why.find("unchecked: too many failed scheduler claims from "
                 "10.0.0.66 this second") != std::string::npos)
      ++unchecked;
  }
  EXPECT_EQ(checked, 4);
  EXPECT_EQ(unchecked, 96);
  std::string user_id, why;
  EXPECT_EQ(
      admission_.Check(scheduler_.User(),
                       scheduler_.PasswordTo(server_.key(), Role::kServer),
                       "10.0.0.1", &user_id, &why),
      Admission::Verdict::kAdmit)
      << why;
  EXPECT_EQ(user_id, scheduler_.User());
}

// The ceiling stays: 16 addresses failing 4 checks each spend the second's
// 64, and a claim from a 17th address (the real scheduler's) is refused
// unchecked until the next second, then admitted.
TEST_F(SchedulerClaimLimitTest, AllAddressesTogetherHaveACeiling) {
  int checked = 0;
  for (int a = 0; a < 20; ++a) {
    for (int i = 0; i < 4; ++i) {
      std::string user_id, why;
      EXPECT_EQ(admission_.Check(attacker_, Z85(Random()),
                                 absl::StrCat("10.0.1.", a), &user_id, &why),
                Admission::Verdict::kRefuse);
      if (why.find("with a password not its pair's") != std::string::npos)
        ++checked;
    }
  }
  EXPECT_EQ(checked, Admission::kSchedulerFailuresPerSecond);
  const std::string password =
      scheduler_.PasswordTo(server_.key(), Role::kServer);
  std::string user_id, why;
  EXPECT_EQ(
      admission_.Check(scheduler_.User(), password, "10.0.0.1", &user_id, &why),
      Admission::Verdict::kRefuse);
  EXPECT_EQ(why,
            absl::StrCat("scheduler node key ", scheduler_.User().substr(10, 8),
                         "..., unchecked: too many failed scheduler "
                         "claims this second"));
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(
      admission_.Check(scheduler_.User(), password, "10.0.0.1", &user_id, &why),
      Admission::Verdict::kAdmit)
      << why;
}

// The configured scheduler address (here 10.0.0.1) has a budget of its
// own, outside the ceiling: once 16 other addresses spent the second's 64
// checks, a claim from a 17th is refused unchecked, but the scheduler's,
// from its address (as an IPv4-mapped IPv6 address too), is checked and
// admitted. (Before, it was refused unchecked with the rest.)
TEST(SchedulerAddressBudgetTest, TheSchedulersAddressHasABudgetOfItsOwn) {
  const JobKeySet job = GenerateJobKeys().value();
  const Process server(job, Role::kServer, kServer),
      scheduler(job, Role::kScheduler, 1);
  Admission admission(server.keys, "10.0.0.1");
  const std::string attacker =
      absl::StrCat("scheduler:", Z85(NodeKey::Generate().public_key()));
  int checked = 0;
  for (int a = 0; a < 16; ++a) {
    for (int i = 0; i < 4; ++i) {
      std::string user_id, why;
      EXPECT_EQ(admission.Check(attacker, Z85(Random()),
                                absl::StrCat("10.0.1.", a), &user_id, &why),
                Admission::Verdict::kRefuse);
      if (why.find("with a password not its pair's") != std::string::npos)
        ++checked;
    }
  }
  EXPECT_EQ(checked, Admission::kSchedulerFailuresPerSecond);
  std::string user_id, why;
  EXPECT_EQ(
      admission.Check(attacker, Z85(Random()), "10.0.2.1", &user_id, &why),
      Admission::Verdict::kRefuse);
  EXPECT_NE(why.find("unchecked: too many failed scheduler claims this "
                     "second"),
            std::string::npos)
      << why;
  EXPECT_EQ(admission.Check(scheduler.User(),
                            scheduler.PasswordTo(server.key(), Role::kServer),
                            "::ffff:10.0.0.1", &user_id, &why),
            Admission::Verdict::kAdmit)
      << why;
  EXPECT_EQ(user_id, scheduler.User());
}

// Bad claims from the scheduler's address spend its own 4 checks a second
// (the rest refused unchecked, naming it), not the ceiling: 16 other
// addresses still have their 64.
TEST(SchedulerAddressBudgetTest, TheSchedulersAddressSpendsOnlyItsOwnBudget) {
  const JobKeySet job = GenerateJobKeys().value();
  const Process server(job, Role::kServer, kServer);
  Admission admission(server.keys, "::ffff:10.0.0.1");
  const std::string attacker =
      absl::StrCat("scheduler:", Z85(NodeKey::Generate().public_key()));
  auto claim = [&](const std::string& from) {
    std::string user_id, why;
    EXPECT_EQ(admission.Check(attacker, Z85(Random()), from, &user_id, &why),
              Admission::Verdict::kRefuse);
    return why;
  };
  int checked = 0, unchecked = 0;
  for (int i = 0; i < 10; ++i) {
    const std::string why = claim("10.0.0.1");
    if (why.find("with a password not its pair's") != std::string::npos)
      ++checked;
    if (why.find("unchecked: too many failed scheduler claims from "
                 "10.0.0.1 this second") != std::string::npos)
      ++unchecked;
  }
  EXPECT_EQ(checked, Admission::kSchedulerFailuresPerAddressPerSecond);
  EXPECT_EQ(unchecked, 6);
  checked = 0;
  for (int a = 0; a < 16; ++a) {
    for (int i = 0; i < 4; ++i) {
      if (claim(absl::StrCat("10.0.1.", a))
              .find("with a password not its pair's") != std::string::npos)
        ++checked;
    }
  }
  EXPECT_EQ(checked, Admission::kSchedulerFailuresPerSecond);
}

// What a table change added, as the ZAP handler asks it: the keys SetPeer
// added after a version, until more than kAddedRemembered came since.
TEST(AdmissionAddedSinceTest, GivesTheKeysAddedAfterAVersion) {
  const JobKeySet job = GenerateJobKeys().value();
  const Process server(job, Role::kServer, kServer);
  Admission admission(server.keys);
  std::vector<Key32> keys;
  bool complete = false;
  EXPECT_EQ(admission.AddedSince(0, &keys, &complete), 0u);
  EXPECT_TRUE(complete);
  const Key32 k1 = Random(), k2 = Random(), k3 = Random();
  admission.SetPeer(9, Role::kWorker, k1);
  admission.SetPeer(10, Role::kWorker, k2);
  admission.RemovePeer(9);  // adds nothing
  admission.SetPeer(11, Role::kWorker, k3);
  EXPECT_EQ(admission.AddedSince(1, &keys, &complete), 3u);
  EXPECT_TRUE(complete);
  EXPECT_EQ(keys.size(), 2u);
  EXPECT_TRUE(std::find(keys.begin(), keys.end(), k2) != keys.end());
  EXPECT_TRUE(std::find(keys.begin(), keys.end(), k3) != keys.end());
  EXPECT_EQ(admission.AddedSince(3, &keys, &complete), 3u);
  EXPECT_TRUE(complete);
  EXPECT_TRUE(keys.empty());
  for (size_t i = 0; i < Admission::kAddedRemembered; ++i)
    admission.SetPeer(100 + static_cast<int>(i), Role::kWorker, Random());
  const uint64_t now = 3 + Admission::kAddedRemembered;
  EXPECT_EQ(admission.AddedSince(3, &keys, &complete), now);
  EXPECT_TRUE(complete);
  EXPECT_EQ(keys.size(), Admission::kAddedRemembered);
  admission.SetPeer(99, Role::kWorker, k1);
  EXPECT_EQ(admission.AddedSince(3, &keys, &complete), now + 1);
  EXPECT_FALSE(complete);  // the key of version 4 is forgotten
  EXPECT_TRUE(keys.empty());
  EXPECT_EQ(admission.AddedSince(now, &keys, &complete), now + 1);
  EXPECT_TRUE(complete);
  EXPECT_EQ(keys, std::vector<Key32>{k1});
}

}  // namespace
}  // namespace tessera::sealed
