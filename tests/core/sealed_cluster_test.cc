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
#include "tests/core/roster.h"
#include "worker/client/kv_client.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// B's options: a worker of the cluster's job with the workers' key file (or
// `key_file`), plus `extra`.
Options WorkerOptions(ProcessCluster& c, const std::string& key_file = "",
                      const std::map<std::string, std::string>& extra = {}) {
  std::map<std::string, std::string> env = {
      {"DMLC_ROLE", "worker"},
      {"DMLC_PS_ROOT_URI", "127.0.0.1"},
      {"DMLC_PS_ROOT_PORT", std::to_string(c.port())},
      {"DMLC_NUM_SERVER", "1"},
      {"DMLC_NUM_WORKER", "2"},
      {"TESSERA_KEY_FILE",
       key_file.empty() ? c.KeyFile(Role::kWorker) : key_file},
      {"TESSERA_START_TIMEOUT", "30"},
  };
  for (const auto& [name, value] : extra) env[name] = value;
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

// A registration as a user's node sends it: a worker at host:port.
Message Registration(int port, uint64_t generation) {
  Message reg;
  reg.header.set_command(wire::REGISTER);
  reg.header.set_plane(wire::CONTROL);
  reg.header.set_generation(generation);
  wire::NodeInfo* info = reg.header.mutable_register_()->mutable_node();
  info->set_role(wire::WORKER);
  info->set_rank(-1);
  info->set_host("127.0.0.1");
  info->set_port(port);
  info->set_generation(generation);
  info->set_node_key(std::string(32, '\x07'));
  info->set_sealed_port(1);
  return reg;
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
  c.Spawn("worker A",
          {BinaryPath("tests/core/kv_check_worker"), "barrier", "4", "300"},
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
  ASSERT_EQ(
      zmq_connect(rogue, absl::StrCat("tcp://127.0.0.1:", server_port).c_str()),
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
  const Roster nodes(c, {"server 0", "worker 0", "worker 1"});
  const std::string scheduler_file = nodes.scheduler_file();
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
  absl::StatusOr<std::vector<Buffer>> parts =
      EncodeMessage(Registration(worker1_port, 1));
  ASSERT_TRUE(parts.ok());
  void* context = zmq_ctx_new();
  const std::string scheduler = absl::StrCat("tcp://127.0.0.1:", c.port());
  const std::string scheduler_public = c.keys().of(Role::kScheduler).public_key;
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
  EXPECT_THAT(log,
              HasSubstr(absl::StrCat("(generation 1) with node key ",
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

// A compromised worker of an elastic job with per-process keys seals a
// registration over its own link to the scheduler, for a worker of its own
// making (issue #46): sealed messages carry no connection key, so the roster
// never saw it. A registration comes only unsealed, claiming no sender, over
// a connection of its node's own key: the sealed one is dropped and counted,
// no rank is taken, and the job ends as an undisturbed one.
TEST(SealedClusterTest, ASealedRegistrationTakesNoRank) {
  ProcessCluster c;
  c.Env("DMLC_NUM_SERVER", "1");
  c.Env("DMLC_NUM_WORKER", "2");
  c.Env("TESSERA_ELASTIC", "2:3");
  const Roster nodes(c, {"server 0", "worker 0", "worker 1"});
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"},
           {"TESSERA_KEY_FILE", nodes.scheduler_file()}});
  c.Spawn("server 0", {BinaryPath("server/tessera-server")},
          {{"DMLC_ROLE", "server"}, {"TESSERA_KEY_FILE", nodes[0].file}});
  c.Spawn("worker A",
          {BinaryPath("tests/core/kv_check_worker"), "barrier", "4", "300"},
          {{"DMLC_ROLE", "worker"}, {"TESSERA_KEY_FILE", nodes[1].file}});
  const Options options =
      WorkerOptions(c, nodes[2].file, {{"TESSERA_ELASTIC", "2:3"}});
  absl::StatusOr<std::unique_ptr<Transport>> made =
      NewZmqTransportForNode(options);
  ASSERT_TRUE(made.ok()) << made.status();
  Transport* transport = made->get();
  absl::StatusOr<std::unique_ptr<KVClient>> b =
      KVClient::Create(options, /*sync=*/true, *std::move(made));
  ASSERT_TRUE(b.ok()) << b.status() << c.AllLogs();
  const int b_id = WorkerId((*b)->rank());
  ASSERT_TRUE((*b)->Barrier().ok());

  // Sealed with B's node key, in B's name (the only sender its seal allows),
  // and in no one's: a third worker at a port nobody listens on.
  const int rogue_port = FreePort();
  for (int sender : {b_id, 0}) {
    Message reg = Registration(rogue_port, 0);
    reg.header.set_sender(sender);
    ASSERT_TRUE(transport->Send(kSchedulerId, reg).ok());
  }
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*b)->Barrier().ok());
  ASSERT_TRUE((*b)->Close().ok());
  b->reset();
  ExpectAllExitZero(c, absl::Seconds(60));

  const std::string log = ProcessCluster::Log(c.Find("scheduler"));
  EXPECT_THAT(log, HasSubstr("a registration claims no sender (it comes "
                             "unsealed, from a node not yet in the job)"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat(
                       "it claims sender 0, but it was sealed with the node "
                       "key of worker id ",
                       b_id)));
  EXPECT_THAT(log, Not(HasSubstr("joins the job")));
  EXPECT_THAT(log, Not(HasSubstr(absl::StrCat(":", rogue_port))));
  EXPECT_THAT(ProcessCluster::Log(c.Find("worker A")),
              HasSubstr("barrier ok: rank"));
}

// Issue #46: the scheduler tells a registration it turns away why (an ABORT
// sealed to the node's key) and drops the link at once. In a sealed job that
// abort must still go out: a server past DMLC_NUM_SERVER before the job forms
// ("too many servers") and one after it formed ("already formed") each end
// within seconds naming the reason, not at their own start deadline (60 s).
// PS_RESEND=0: they register once, so only the first abort can tell them.
TEST(SealedClusterTest, ATurnedAwayServerHearsItsAbortAtOnce) {
  ProcessCluster c;
  c.Env("DMLC_NUM_SERVER", "1");
  c.Env("DMLC_NUM_WORKER", "1");
  c.Env("TESSERA_START_TIMEOUT", "60");
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"}});
  c.Spawn("server 0", {BinaryPath("server/tessera-server")},
          {{"DMLC_ROLE", "server"}});
  absl::SleepFor(absl::Milliseconds(700));  // server 0 registers first
  const std::map<std::string, std::string> extra = {{"DMLC_ROLE", "server"},
                                                    {"PS_RESEND", "0"}};
  Child& early =
      c.Spawn("server early", {BinaryPath("server/tessera-server")}, extra);
  ASSERT_TRUE(c.Wait(early, absl::Seconds(10)))
      << "a server past DMLC_NUM_SERVER still runs 10 s on\n"
      << c.AllLogs();
  EXPECT_NE(ProcessCluster::ExitCode(early), 0);
  EXPECT_THAT(ProcessCluster::Log(early),
              HasSubstr("the scheduler ended the job: too many servers: "
                        "expected 1"));
  c.Spawn("worker", {Worker(), "barrier", "30", "300"},
          {{"DMLC_ROLE", "worker"}});
  absl::SleepFor(absl::Seconds(1));  // the job forms
  Child& late =
      c.Spawn("server late", {BinaryPath("server/tessera-server")}, extra);
  ASSERT_TRUE(c.Wait(late, absl::Seconds(10)))
      << "a server after the job formed still runs 10 s on\n"
      << c.AllLogs();
  EXPECT_NE(ProcessCluster::ExitCode(late), 0);
  EXPECT_THAT(ProcessCluster::Log(late),
              HasSubstr("the scheduler ended the job: the job is already "
                        "formed"));
  c.KillAll();
}

}  // namespace
}  // namespace tessera::testing
