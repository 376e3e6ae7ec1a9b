// Per-node identity in a secured job (issue #25), against real daemons: a
// registered worker, holding the workers' role key and its own node key,
// cannot speak for another worker, neither to the server nor to the
// scheduler, sealed or unsealed; the job ends as an undisturbed one does.
//
// The job: tessera-scheduler, one tessera-server, worker A (kv_check_worker
// "barrier") and worker B, which is this test: a real KVClient over a ZeroMQ
// transport the test keeps a pointer to, so that after joining it can send
// what a compromised worker would.
#include <sys/stat.h>
#include <zmq.h>

#include <fstream>
#include <iterator>

#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/curve_keys.h"
#include "common/message.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/cluster_expect.h"
#include "tests/core/process_cluster.h"
#include "worker/client/kv_client.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

int64_t SummaryCount(const std::string& log, const std::string& name) {
  std::smatch m;
  const std::regex re(name + " (\\d+)");
  if (!std::regex_search(log, m, re)) return -1;
  int64_t n = -1;
  (void)absl::SimpleAtoi(m[1].str(), &n);
  return n;
}

// B's options: a worker of the cluster's job with the workers' key file.
Options WorkerOptions(ProcessCluster& c) {
  std::map<std::string, std::string> env = {
      {"DMLC_ROLE", "worker"},
      {"DMLC_PS_ROOT_URI", "127.0.0.1"},
      {"DMLC_PS_ROOT_PORT", std::to_string(c.port())},
      {"DMLC_NUM_SERVER", "1"},
      {"DMLC_NUM_WORKER", "2"},
      {"TESSERA_KEY_FILE", c.KeyFile(Role::kWorker)},
      {"TESSERA_START_TIMEOUT", "30"},
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

Message Forged(wire::Command command, int sender, int recipient,
               wire::Plane plane) {
  Message m;
  m.header.set_command(command);
  m.header.set_sender(sender);
  m.header.set_recipient(recipient);
  m.header.set_plane(plane);
  m.header.set_request_id((uint64_t{1} << 44) + 1);
  return m;
}

TEST(SealedClusterTest, AWorkersKeysCannotSpeakForAnotherWorker) {
  ProcessCluster c;
  c.Env("DMLC_NUM_SERVER", "1");
  c.Env("DMLC_NUM_WORKER", "2");
  const int server_port = FreePort();
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"}});
  c.Spawn("server 0", {BinaryPath("server/tessera-server")},
          {{"DMLC_ROLE", "server"}, {"PORT", std::to_string(server_port)}});
  c.Spawn("worker A", {BinaryPath("tests/core/kv_check_worker"), "barrier",
                       "4", "300"},
          {{"DMLC_ROLE", "worker"}});

  const Options options = WorkerOptions(c);
  absl::StatusOr<std::unique_ptr<Transport>> made =
      NewZmqTransportForNode(options);
  ASSERT_TRUE(made.ok()) << made.status();
  Transport* transport = made->get();
  absl::StatusOr<std::unique_ptr<KVClient>> b =
      KVClient::Create(options, /*sync=*/true, *std::move(made));
  ASSERT_TRUE(b.ok()) << b.status() << c.AllLogs();
  const int b_id = WorkerId((*b)->rank());
  const int a_id = WorkerId(1 - (*b)->rank());
  ASSERT_TRUE((*b)->Barrier().ok());

  // Sealed, over B's own links: a push to the server and "I am done" to the
  // scheduler, both in A's name.
  Message push = Forged(wire::KV_PUSH, a_id, ServerId(0), wire::DATA);
  push.header.mutable_slice()->set_key(5);
  push.header.mutable_slice()->set_length(2);
  push.header.mutable_slice()->set_total_length(2);
  const float values[2] = {1, 2};
  AddFloatFrame(&push, Buffer::CopyOf(values, sizeof(values)));
  ASSERT_TRUE(transport->Send(ServerId(0), push).ok());
  ASSERT_TRUE(transport
                  ->Send(kSchedulerId, Forged(wire::WORKER_DONE, a_id,
                                              kSchedulerId, wire::CONTROL))
                  .ok());
  // Unsealed, with the workers' role key over CURVE to the server's port:
  // what a worker could do when one key stood for every worker.
  void* context = zmq_ctx_new();
  void* rogue = zmq_socket(context, ZMQ_PUSH);
  UseJobKey(rogue, c.keys(), Role::kWorker, Role::kServer);
  ASSERT_EQ(zmq_connect(rogue, absl::StrCat("tcp://127.0.0.1:", server_port)
                                   .c_str()),
            0);
  absl::StatusOr<std::vector<Buffer>> parts = EncodeMessage(push);
  ASSERT_TRUE(parts.ok());
  for (size_t i = 0; i < parts->size(); ++i) {
    zmq_send(rogue, (*parts)[i].data(), (*parts)[i].size(),
             i + 1 < parts->size() ? ZMQ_SNDMORE : 0);
  }

  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*b)->Barrier().ok());
  ASSERT_TRUE((*b)->Close().ok());
  b->reset();
  const int linger = 1000;
  zmq_setsockopt(rogue, ZMQ_LINGER, &linger, sizeof(linger));
  zmq_close(rogue);
  zmq_ctx_term(context);
  ExpectAllExitZero(c, absl::Seconds(60));

  const std::string server = ProcessCluster::Log(c.Find("server 0"));
  const std::string scheduler = ProcessCluster::Log(c.Find("scheduler"));
  const std::string claim =
      absl::StrCat("it claims sender ", a_id,
                   ", but it was sealed with the node key of worker id ", b_id);
  EXPECT_THAT(server, HasSubstr(claim));
  EXPECT_THAT(scheduler, HasSubstr(claim));
  EXPECT_THAT(server, HasSubstr("dropped unsealed message #1: in a sealed "
                                "job only a registration comes unsealed"));
  EXPECT_EQ(SummaryCount(server, "pushes applied"), 0) << server;
  EXPECT_EQ(SummaryCount(server, "wrong sender"), 1) << server;
  EXPECT_THAT(server, HasSubstr("sealed drops 2 (wrong sender 1, unsealed 1)"));
  // A finished alone, after its four barriers: the scheduler did not take
  // B's word for it.
  EXPECT_THAT(ProcessCluster::Log(c.Find("worker A")),
              HasSubstr("barrier ok: rank"));
}

// launch.py gives every process a key of its own and the scheduler the list
// of them. A worker holding its own key (and its role's) cannot take another
// worker's place by registering as its restart, nor register with the
// workers' role key at all; the job ends as an undisturbed one.
TEST(SealedClusterTest, AWorkersOwnKeyCannotRegisterAsAnotherWorkersRestart) {
  ProcessCluster c;
  c.Env("DMLC_NUM_SERVER", "1");
  c.Env("DMLC_NUM_WORKER", "2");
  // Key files as launch.py writes them: the role's, plus a node key.
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  auto write = [](const std::string& path, const std::string& text) {
    std::ofstream(path) << text;
    ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  };
  struct NodeKeys {
    std::string name, role, file;
    CurveKeyPair pair;
  };
  std::vector<NodeKeys> nodes = {{"server 0", "server", "", {}},
                                 {"worker 0", "worker", "", {}},
                                 {"worker 1", "worker", "", {}}};
  std::string roster;
  for (NodeKeys& n : nodes) {
    char pub[41], sec[41];
    ASSERT_EQ(zmq_curve_keypair(pub, sec), 0);
    n.pair = {pub, sec};
    n.file = c.dir() + "/" + n.role + "-" + n.name.substr(7) + ".key";
    write(n.file, read(c.KeyFile(n.role == "server" ? Role::kServer
                                                     : Role::kWorker)) +
                      "node-secret-key " + n.pair.secret_key + "\n");
    roster += "node-key " + n.role + " " + n.pair.public_key + "\n";
  }
  const std::string scheduler_file = c.dir() + "/scheduler-roster.key";
  write(scheduler_file, read(c.KeyFile(Role::kScheduler)) + roster);
  const int worker1_port = FreePort();
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"}, {"TESSERA_KEY_FILE", scheduler_file}});
  c.Spawn("server 0", {BinaryPath("server/tessera-server")},
          {{"DMLC_ROLE", "server"}, {"TESSERA_KEY_FILE", nodes[0].file}});
  for (int w = 0; w < 2; ++w) {
    std::map<std::string, std::string> env = {
        {"DMLC_ROLE", "worker"}, {"TESSERA_KEY_FILE", nodes[1 + w].file}};
    if (w == 1) env["PORT"] = std::to_string(worker1_port);
    c.Spawn(nodes[1 + w].name,
            {BinaryPath("tests/core/kv_check_worker"), "barrier", "6", "300"},
            env);
  }
  absl::SleepFor(absl::Milliseconds(900));  // the job forms

  // Worker 0's keys (its own and the workers'), registering as worker 1's
  // next life.
  Message reg;
  reg.header.set_command(wire::REGISTER);
  reg.header.set_plane(wire::CONTROL);
  reg.header.set_generation(1);
  wire::NodeInfo* info = reg.header.mutable_register_()->mutable_node();
  info->set_role(wire::WORKER);
  info->set_rank(-1);
  info->set_host("127.0.0.1");
  info->set_port(worker1_port);
  info->set_generation(1);
  info->set_node_key(std::string(32, '\x07'));
  info->set_sealed_port(1);
  absl::StatusOr<std::vector<Buffer>> parts = EncodeMessage(reg);
  ASSERT_TRUE(parts.ok());
  void* context = zmq_ctx_new();
  const std::string scheduler = absl::StrCat("tcp://127.0.0.1:", c.port());
  const std::string scheduler_public =
      c.keys().of(Role::kScheduler).public_key;
  std::vector<void*> rogues;
  for (bool own : {true, false}) {
    void* s = zmq_socket(context, ZMQ_PUSH);
    const std::string& pub =
        own ? nodes[1].pair.public_key : c.keys().of(Role::kWorker).public_key;
    const std::string& sec =
        own ? nodes[1].pair.secret_key : c.keys().of(Role::kWorker).secret_key;
    zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, scheduler_public.data(), 40);
    zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, pub.data(), 40);
    zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, sec.data(), 40);
    ASSERT_EQ(zmq_connect(s, scheduler.c_str()), 0);
    zmq_send(s, (*parts)[0].data(), (*parts)[0].size(), 0);
    rogues.push_back(s);
  }
  ExpectAllExitZero(c, absl::Seconds(60));
  const int linger = 0;
  for (void* s : rogues) {
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_close(s);
  }
  zmq_ctx_term(context);

  const std::string log = ProcessCluster::Log(c.Find("scheduler"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat(
                       "(generation 1) with node key ",
                       KeyPrefix(nodes[1].pair.public_key),
                       ": that node registered with ",
                       KeyPrefix(nodes[2].pair.public_key))));
  EXPECT_THAT(log, HasSubstr("it registers with the worker key, but every "
                             "node of this job registers with a key of its "
                             "own"));
  EXPECT_THAT(log, Not(HasSubstr("restarted")));
  for (const char* w : {"worker 0", "worker 1"}) {
    EXPECT_THAT(ProcessCluster::Log(c.Find(w)), HasSubstr("barrier ok"));
  }
}

}  // namespace
}  // namespace tessera::testing
