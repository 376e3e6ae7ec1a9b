// A secured job on loopback (real tessera-scheduler and tessera-server, C-API
// soak workers) under attack from peers on the same network: outsiders with no
// key, a wrong key, a NULL-mechanism socket, a PLAIN guess and a plain TCP
// connection deliver nothing; a worker's or server's key cannot send control
// commands or claim another role's id; a key file others can read, keys of
// another role, or no keys at all stop a daemon with exit 2.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/curve_keys.h"
#include "common/message.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/cluster_expect.h"
#include "tests/core/process_cluster.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kRounds = 30;
constexpr int kSleepMs = 40;  // per round: the attacks land mid-job

std::string Checksum(const std::string& log) {
  std::smatch m;
  static const std::regex re("soak ok: .* checksum=([0-9a-f]{16})");
  if (!std::regex_search(log, m, re)) return "";
  return m[1];
}

struct Ports {
  int server = 0;
  int worker0 = 0;
  int worker1 = 0;
};

// One server and two soak workers with fixed ports, so that attackers know
// where to go.
Ports StartSoak(ProcessCluster& c) {
  Ports p{FreePort(), FreePort(), FreePort()};
  c.Env("DMLC_NUM_SERVER", "1");
  c.Env("DMLC_NUM_WORKER", "2");
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"}});
  c.Spawn("server 0", {BinaryPath("server/tessera-server")},
          {{"DMLC_ROLE", "server"}, {"PORT", std::to_string(p.server)}});
  const std::vector<std::string> soak = {
      Worker(), "soak", std::to_string(kRounds), std::to_string(kSleepMs)};
  c.Spawn("worker 0", soak,
          {{"DMLC_ROLE", "worker"}, {"PORT", std::to_string(p.worker0)}});
  c.Spawn("worker 1", soak,
          {{"DMLC_ROLE", "worker"}, {"PORT", std::to_string(p.worker1)}});
  return p;
}

struct Undisturbed {
  std::string checksum;
  int64_t pushes = -1;
};

// The checksum and the server's pushes applied of an undisturbed secured run.
const Undisturbed& UndisturbedRun() {
  static const Undisturbed* run = [] {
    auto* u = new Undisturbed;
    ProcessCluster c;
    StartSoak(c);
    ExpectAllExitZero(c, absl::Seconds(120));
    u->checksum = Checksum(ProcessCluster::Log(c.Find("worker 0")));
    u->pushes =
        SummaryCount(ProcessCluster::Log(c.Find("server 0")), "pushes applied");
    EXPECT_EQ(u->checksum.size(), 16u) << c.AllLogs();
    return u;
  }();
  return *run;
}

std::string Endpoint(int port) {
  return absl::StrCat("tcp://127.0.0.1:", port);
}

Message Control(wire::Command command, int sender, const std::string& why) {
  Message m;
  m.header.set_command(command);
  m.header.set_sender(sender);
  m.header.set_plane(wire::CONTROL);
  m.header.set_request_id(77);
  if (command == wire::ABORT) m.header.mutable_abort()->set_reason(why);
  return m;
}

// A push of `values` ones into the soak's small key (3, six values).
Message Push(int sender, int recipient) {
  static const std::vector<float> ones(6, 1000.0f);
  Message m;
  m.header.set_command(wire::KV_PUSH);
  m.header.set_sender(sender);
  m.header.set_recipient(recipient);
  m.header.set_plane(wire::DATA);
  m.header.set_request_id((uint64_t{1} << 40) + 1);
  m.header.set_push_seq(1);
  m.header.mutable_kv_options()->set_sync_mode(true);
  wire::KeySlice* slice = m.header.mutable_slice();
  slice->set_key(3);
  slice->set_length(6);
  slice->set_total_length(6);
  AddFloatFrame(&m, Buffer::Wrap(ones.data(), ones.size() * 4, nullptr));
  return m;
}

// The messages every outsider tries on a server or worker: the rogue
// ABORT, a TERMINATE, pushes and pulls under a worker's id.
std::vector<Message> NodeAttack(int recipient) {
  std::vector<Message> all = {
      Control(wire::ABORT, kSchedulerId, "rogue peer says stop"),
      Control(wire::TERMINATE, kSchedulerId, ""),
      Push(WorkerId(0), recipient),
  };
  Message pull = Push(WorkerId(1), recipient);
  pull.header.set_command(wire::KV_PULL);
  pull.header.clear_frames();
  pull.data.clear();
  all.push_back(pull);
  return all;
}

// ... and on the scheduler: both workers "done" (an early end of the job) and
// a registration.
std::vector<Message> SchedulerAttack() {
  std::vector<Message> all = {Control(wire::WORKER_DONE, WorkerId(0), ""),
                              Control(wire::WORKER_DONE, WorkerId(1), "")};
  Message reg = Control(wire::REGISTER, 0, "");
  wire::NodeInfo* info = reg.header.mutable_register_()->mutable_node();
  info->set_role(wire::SERVER);
  info->set_host("127.0.0.1");
  info->set_port(1);
  all.push_back(reg);
  return all;
}

void SendAll(void* socket, const std::vector<Message>& messages) {
  for (const Message& m : messages) {
    absl::StatusOr<std::vector<Buffer>> parts = EncodeMessage(m);
    ASSERT_TRUE(parts.ok()) << parts.status();
    for (size_t i = 0; i < parts->size(); ++i) {
      const Buffer& b = (*parts)[i];
      // Queued (ZeroMQ accepts it while the connection is being made); what
      // matters is whether it is ever delivered.
      zmq_send(socket, b.data(), b.size(),
               (i + 1 < parts->size() ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT);
    }
  }
}

// Raw ZeroMQ peers of one test; closed without lingering.
class Peers {
 public:
  Peers() : context_(zmq_ctx_new()) {}
  ~Peers() {
    const int linger = 0;
    for (void* s : sockets_) {
      zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
      zmq_close(s);
    }
    zmq_ctx_term(context_);
  }
  // A PUSH socket; `configure` sets its security before it connects.
  template <typename Configure>
  void* Connect(int port, Configure configure) {
    void* s = zmq_socket(context_, ZMQ_PUSH);
    const int reconnect_ms = 50;
    zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &reconnect_ms, sizeof(reconnect_ms));
    configure(s);
    EXPECT_EQ(zmq_connect(s, Endpoint(port).c_str()), 0);
    sockets_.push_back(s);
    return s;
  }

 private:
  void* context_;
  std::vector<void*> sockets_;
};

// What a peer with no ZeroMQ at all can do: connect and write bytes, here a
// ZMTP 3.0 greeting for the NULL mechanism and the ABORT header.
void PlainTcpAttack(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    std::string greeting(64, '\0');
    greeting[0] = '\xff';
    greeting[9] = '\x7f';
    greeting[10] = 3;  // ZMTP 3.0
    greeting.replace(12, 4, "NULL");
    std::string abort =
        Control(wire::ABORT, kSchedulerId, "rogue peer says stop")
            .header.SerializeAsString();
    std::string frame = std::string(1, '\0') +
                        std::string(1, static_cast<char>(abort.size())) + abort;
    // MSG_NOSIGNAL: the server closes the connection when it refuses the
    // greeting, and a write after that must fail with EPIPE, not kill the
    // test with SIGPIPE (it did under ThreadSanitizer's slower timing).
    (void)!send(fd, greeting.data(), greeting.size(), MSG_NOSIGNAL);
    (void)!send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
    (void)!send(fd, std::string(4096, '\x42').data(), 4096, MSG_NOSIGNAL);
  }
  close(fd);
}

// Every process exited 0, each worker with the undisturbed checksum, and the
// server applied exactly the undisturbed run's pushes and dropped nothing for
// being malformed.
void ExpectUndisturbed(ProcessCluster& c) {
  const Undisturbed& want = UndisturbedRun();
  for (const char* w : {"worker 0", "worker 1"}) {
    EXPECT_EQ(Checksum(ProcessCluster::Log(c.Find(w))), want.checksum)
        << c.AllLogs();
  }
  const std::string server = ProcessCluster::Log(c.Find("server 0"));
  EXPECT_EQ(SummaryCount(server, "pushes applied"), want.pushes) << server;
  EXPECT_EQ(SummaryCount(server, "malformed"), 0) << server;
  EXPECT_THAT(server, Not(HasSubstr("ended the job")));
}

TEST(SecurityTest, OutsidersWithoutTheJobsKeysDeliverNothing) {
  UndisturbedRun();
  ProcessCluster c;
  const Ports ports = StartSoak(c);
  absl::SleepFor(absl::Milliseconds(700));  // the job forms and trains
  absl::StatusOr<JobKeySet> other = GenerateJobKeys();  // another job's
  ASSERT_TRUE(other.ok());
  const JobKeySet& mine = c.keys();
  Peers peers;
  const int node_ports[] = {ports.server, ports.worker0, ports.worker1};
  const Role node_roles[] = {Role::kServer, Role::kWorker, Role::kWorker};
  const int recipients[] = {ServerId(0), WorkerId(0), WorkerId(1)};
  for (int i = 0; i < 4; ++i) {
    const int port = i < 3 ? node_ports[i] : c.port();
    const Role role = i < 3 ? node_roles[i] : Role::kScheduler;
    const std::vector<Message> attack =
        i < 3 ? NodeAttack(recipients[i]) : SchedulerAttack();
    // (1) A key pair this job does not know (another job's), and the node's
    // real public key (public keys are no secret): the ZAP handler refuses it.
    SendAll(peers.Connect(
                port,
                [&](void* s) {
                  UseJobKey(s, *other, Role::kWorker, role);
                  const std::string& server_key = mine.of(role).public_key;
                  zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, server_key.data(),
                                 server_key.size());
                }),
            attack);
    // (2) Another job's keys throughout: the node cannot open its hello.
    SendAll(
        peers.Connect(
            port, [&](void* s) { UseJobKey(s, *other, Role::kWorker, role); }),
        attack);
    // (3) No security at all: the NULL mechanism.
    SendAll(peers.Connect(port, [](void*) {}), attack);
    // (4) PLAIN, guessing a worker's password.
    SendAll(peers.Connect(port,
                          [](void* s) {
                            zmq_setsockopt(s, ZMQ_PLAIN_USERNAME, "worker", 6);
                            zmq_setsockopt(s, ZMQ_PLAIN_PASSWORD, "guess", 5);
                          }),
            attack);
    // (5) Plain TCP.
    PlainTcpAttack(port);
  }
  ExpectAllExitZero(c, absl::Seconds(120));
  ExpectUndisturbed(c);
  const std::string server = ProcessCluster::Log(c.Find("server 0"));
  EXPECT_EQ(SummaryCount(server, "wrong sender"), 0) << server;
  // The CURVE client with the node's real key reaches the ZAP handler, which
  // names the client's key (and refuses it again at every reconnection).
  EXPECT_GE(SummaryCount(server, "refused connections"), 1) << server;
  EXPECT_THAT(server, HasSubstr("CURVE key " +
                                KeyPrefix(other->of(Role::kWorker).public_key) +
                                " is not one of this job's keys"));
  for (const Child& child : c.children()) {
    const std::string log = ProcessCluster::Log(child);
    EXPECT_THAT(log, Not(HasSubstr("dropped message"))) << child.name;
    EXPECT_THAT(log, Not(HasSubstr("rogue peer"))) << child.name;
  }
  EXPECT_THAT(ProcessCluster::Log(c.Find("scheduler")),
              HasSubstr("is not one of this job's keys"));
}

// Insiders with the wrong role: the workers' key (and the servers') cannot
// send what only the scheduler sends, nor claim another role's id.
TEST(SecurityTest, ControlFromANonSchedulerKeyIsDroppedNamingTheKey) {
  UndisturbedRun();
  ProcessCluster c;
  const Ports ports = StartSoak(c);
  absl::SleepFor(absl::Milliseconds(700));
  Peers peers;
  const JobKeySet& keys = c.keys();
  // The workers' key to the server: the rogue ABORT and TERMINATE as the
  // scheduler (id 1), then under a worker's own id.
  void* to_server = peers.Connect(ports.server, [&](void* s) {
    UseJobKey(s, keys, Role::kWorker, Role::kServer);
  });
  SendAll(to_server,
          {Control(wire::ABORT, kSchedulerId, "rogue peer says stop"),
           Control(wire::TERMINATE, kSchedulerId, ""),
           Control(wire::ABORT, WorkerId(0), "rogue peer says stop"),
           Control(wire::TERMINATE, WorkerId(0), "")});
  // The servers' key to worker 0: an ABORT under the server's own id.
  void* to_worker = peers.Connect(ports.worker0, [&](void* s) {
    UseJobKey(s, keys, Role::kServer, Role::kWorker);
  });
  SendAll(to_worker,
          {Control(wire::ABORT, ServerId(0), "rogue peer says stop")});
  // The workers' key to worker 1, posing as the server (id 8) with a push's
  // answer.
  void* posing = peers.Connect(ports.worker1, [&](void* s) {
    UseJobKey(s, keys, Role::kWorker, Role::kWorker);
  });
  Message answer = Push(ServerId(0), WorkerId(1));
  answer.header.set_is_response(true);
  SendAll(posing, {answer});
  // The workers' key to the scheduler: "every worker is done" as the
  // scheduler itself, and a registration as a server.
  void* to_scheduler = peers.Connect(c.port(), [&](void* s) {
    UseJobKey(s, keys, Role::kWorker, Role::kScheduler);
  });
  Message reg = SchedulerAttack()[2];
  SendAll(to_scheduler, {Control(wire::WORKER_DONE, kSchedulerId, ""), reg});

  ExpectAllExitZero(c, absl::Seconds(120));
  ExpectUndisturbed(c);
  const std::string worker_key = KeyPrefix(keys.of(Role::kWorker).public_key);
  const std::string server_key = KeyPrefix(keys.of(Role::kServer).public_key);
  const std::string server = ProcessCluster::Log(c.Find("server 0"));
  EXPECT_EQ(SummaryCount(server, "wrong sender"), 4) << server;
  EXPECT_EQ(SummaryCount(server, "refused connections"), 0) << server;
  EXPECT_THAT(server, HasSubstr("dropped message #1 from key " + worker_key +
                                ": it claims sender 1 (a scheduler), but it "
                                "came with the worker key"));
  EXPECT_THAT(server, HasSubstr("dropped message #3 from key " + worker_key +
                                ": only the scheduler sends ABORT, but it "
                                "came with the worker key"));
  EXPECT_THAT(server, HasSubstr(": only the scheduler sends TERMINATE"));
  EXPECT_THAT(ProcessCluster::Log(c.Find("worker 0")),
              HasSubstr("dropped message #1 from key " + server_key +
                        ": only the scheduler sends ABORT, but it came with "
                        "the server key"));
  EXPECT_THAT(ProcessCluster::Log(c.Find("worker 1")),
              HasSubstr("dropped message #1 from key " + worker_key +
                        ": it claims sender 8 (a server)"));
  const std::string scheduler = ProcessCluster::Log(c.Find("scheduler"));
  EXPECT_THAT(scheduler, HasSubstr("dropped message #1 from key " + worker_key +
                                   ": it claims sender 1 (a scheduler)"));
  EXPECT_THAT(scheduler, HasSubstr("dropped message #2 from key " + worker_key +
                                   ": it registers as SERVER"));
  for (const Child& child : c.children()) {
    EXPECT_THAT(ProcessCluster::Log(child), Not(HasSubstr("rogue peer")))
        << child.name;
  }
}

// TESSERA_AUTH_ONLY=1: the same keys through PLAIN, bytes in the clear. The
// job ends as an encrypted one does; a guessed password and a CURVE client are
// refused.
TEST(SecurityTest, AuthOnlyJobMatchesAndRefusesWrongPasswords) {
  UndisturbedRun();
  ProcessCluster c;
  c.Env("TESSERA_AUTH_ONLY", "1");
  const Ports ports = StartSoak(c);
  absl::SleepFor(absl::Milliseconds(700));
  Peers peers;
  SendAll(peers.Connect(ports.server,
                        [](void* s) {
                          zmq_setsockopt(s, ZMQ_PLAIN_USERNAME, "scheduler", 9);
                          zmq_setsockopt(s, ZMQ_PLAIN_PASSWORD, "guess", 5);
                        }),
          NodeAttack(ServerId(0)));
  SendAll(peers.Connect(ports.server,
                        [&](void* s) {
                          UseJobKey(s, c.keys(), Role::kWorker, Role::kServer);
                        }),
          NodeAttack(ServerId(0)));
  ExpectAllExitZero(c, absl::Seconds(120));
  ExpectUndisturbed(c);
  const std::string server = ProcessCluster::Log(c.Find("server 0"));
  EXPECT_THAT(server,
              HasSubstr("PLAIN user 'scheduler' with a wrong password"));
  EXPECT_EQ(SummaryCount(server, "wrong sender"), 0) << server;
}

// A daemon that cannot use the job's keys, or has none, stops at once with
// exit 2 and one line naming the variable.
struct KeyProblem {
  std::string name;
  std::string binary;
  std::string role;
  std::string message;
};

class KeyProblemTest : public ::testing::TestWithParam<KeyProblem> {};

TEST_P(KeyProblemTest, ExitsTwoNamingTheVariable) {
  const KeyProblem& p = GetParam();
  ProcessCluster c;
  c.Env("DMLC_NUM_SERVER", "1");
  c.Env("DMLC_NUM_WORKER", "1");
  c.Env("TESSERA_START_TIMEOUT", "3");
  std::map<std::string, std::string> env = {{"DMLC_ROLE", p.role}};
  const std::string copy = c.dir() + "/copy.key";
  const Role role = p.role == "server"   ? Role::kServer
                    : p.role == "worker" ? Role::kWorker
                                         : Role::kScheduler;
  if (p.name == "world_readable" || p.name == "group_readable") {
    std::ifstream in(c.KeyFile(role));
    std::ofstream(copy) << in.rdbuf();
    ASSERT_EQ(chmod(copy.c_str(), p.name == "world_readable" ? 0644 : 0640), 0);
    env["TESSERA_KEY_FILE"] = copy;
  } else if (p.name == "other_role") {
    env["TESSERA_KEY_FILE"] = c.KeyFile(Role::kWorker);
  } else if (p.name == "none") {
    env["TESSERA_KEY_DIR"] = "";
  } else if (p.name == "corrupt") {
    std::ofstream(copy) << "role server\nsecret-key short\n";
    ASSERT_EQ(chmod(copy.c_str(), 0600), 0);
    env["TESSERA_KEY_FILE"] = copy;
  }
  Child& child = c.Spawn("node", {BinaryPath(p.binary)}, env);
  ASSERT_TRUE(c.Wait(child, absl::Seconds(20))) << c.AllLogs();
  EXPECT_EQ(ProcessCluster::ExitCode(child), 2) << c.AllLogs();
  const std::string log = ProcessCluster::Log(child);
  EXPECT_THAT(log, HasSubstr(p.message));
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 1) << "one line: " << log;
}

INSTANTIATE_TEST_SUITE_P(
    Daemons, KeyProblemTest,
    ::testing::Values(
        KeyProblem{"world_readable", "server/tessera-server", "server",
                   "mode 0644 lets its group or others at the secret key; "
                   "expected 0600 or 0400"},
        KeyProblem{"group_readable", "scheduler/tessera-scheduler", "scheduler",
                   "mode 0640 lets its group or others"},
        KeyProblem{"world_readable", "worker/tessera-worker", "worker",
                   "mode 0644 lets its group or others at the secret key"},
        KeyProblem{"other_role", "server/tessera-server", "server",
                   "keys of role worker; this process is a server "
                   "(DMLC_ROLE)"},
        KeyProblem{"none", "scheduler/tessera-scheduler", "scheduler",
                   "no keys for this job's connections: set "
                   "TESSERA_KEY_FILE"},
        KeyProblem{"none", "server/tessera-server", "server",
                   "or TESSERA_INSECURE=1 to run without authentication"},
        KeyProblem{"corrupt", "server/tessera-server", "server",
                   "line 2: secret-key: expected a key of 40 Z85 "
                   "characters"}),
    [](const ::testing::TestParamInfo<KeyProblem>& info) {
      return absl::StrCat(info.param.name, "_", info.param.role);
    });

// TESSERA_INSECURE=1 and no keys: the job runs as before, and each daemon
// says once that it is open.
TEST(SecurityTest, InsecureSwitchRunsTheJobWithOneWarningLine) {
  ProcessCluster c;
  c.Env("TESSERA_INSECURE", "1");
  c.Env("TESSERA_KEY_DIR", "");
  c.Start(1, 1, {Worker(), "barrier", "3"});
  ExpectAllExitZero(c, absl::Seconds(60));
  for (const Child& child : c.children()) {
    const std::string log = ProcessCluster::Log(child);
    size_t count = 0;
    for (size_t at = log.find("TESSERA_INSECURE=1: connections are neither");
         at != std::string::npos;
         at = log.find("TESSERA_INSECURE=1: connections", at + 1)) {
      ++count;
    }
    EXPECT_EQ(count, 1u) << child.name << ":\n" << log;
  }
}

}  // namespace
}  // namespace tessera::testing
