// Faults on loopback, with real processes: lost messages and lost
// acknowledgements (PS_DROP_MSG), a server that stops answering, and a server
// SIGKILLed mid-job and restarted from its checkpoint. Each job's final weights
// are compared with a fault-free run's, and each server's per-key count of
// applied pushes with workers x rounds.
#include <signal.h>
#include <stdlib.h>

#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/cluster_expect.h"
#include "tests/core/process_cluster.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorkers = 2;
constexpr int kServers = 2;

// The checksum a soak worker printed ("soak ok: ... checksum=HEX").
std::string Checksum(const std::string& log) {
  std::smatch m;
  static const std::regex re("soak ok: .* checksum=([0-9a-f]{16})");
  if (!std::regex_search(log, m, re)) return "";
  return m[1];
}

// A server's exit summary: per key, the pushes it applied, plus duplicates.
struct ServerSummary {
  bool found = false;
  std::map<uint64_t, uint64_t> key_pushes;
  uint64_t duplicates = 0;
};

ServerSummary Summary(const std::string& log) {
  ServerSummary s;
  static const std::regex line(
      R"(pushes applied \d+ \(([^)]*)\), rounds \d+, duplicates (\d+))");
  std::smatch m;
  // The last summary in the log (a restarted server's log has only its own).
  std::string rest = log;
  while (std::regex_search(rest, m, line)) {
    s.found = true;
    s.key_pushes.clear();
    const std::string keys = m[1];
    static const std::regex pair(R"(key (\d+): (\d+))");
    for (auto it = std::sregex_iterator(keys.begin(), keys.end(), pair);
         it != std::sregex_iterator(); ++it) {
      uint64_t k = 0, n = 0;
      (void)absl::SimpleAtoi((*it)[1].str(), &k);
      (void)absl::SimpleAtoi((*it)[2].str(), &n);
      s.key_pushes[k] = n;
    }
    (void)absl::SimpleAtoi(m[2].str(), &s.duplicates);
    rest = m.suffix();
  }
  return s;
}

void CommonEnv(ProcessCluster& c) {
  // Key 99 (5000 values) is split over both servers; key 3 lives on one.
  c.Env("TESSERA_BIGARRAY_BOUND", "1000");
  c.Env("PS_RESEND_TIMEOUT", "50");
}

// The checksum of a fault-free soak run of `rounds` rounds.
std::string FaultFreeChecksum(int rounds) {
  ProcessCluster c;
  CommonEnv(c);
  c.Start(kServers, kWorkers, {Worker(), "soak", std::to_string(rounds)});
  ExpectAllExitZero(c, absl::Seconds(120));
  const std::string sum = Checksum(ProcessCluster::Log(c.Find("worker 0")));
  EXPECT_EQ(sum.size(), 16u) << c.AllLogs();
  return sum;
}

// Every worker finished the soak with `want` as its checksum, and every key's
// pushes were applied exactly workers x rounds times on each server holding
// (a part of) it. Returns the total number of duplicates the servers saw.
uint64_t ExpectExactlyOnce(ProcessCluster& c, const std::string& want,
                           int rounds,
                           const std::vector<std::string>& servers) {
  for (int w = 0; w < kWorkers; ++w) {
    const std::string log =
        ProcessCluster::Log(c.Find(absl::StrCat("worker ", w)));
    EXPECT_EQ(Checksum(log), want) << log;
  }
  uint64_t duplicates = 0;
  std::map<uint64_t, int> holders;
  for (const std::string& name : servers) {
    const ServerSummary s = Summary(ProcessCluster::Log(c.Find(name)));
    EXPECT_TRUE(s.found) << name << ":\n" << ProcessCluster::Log(c.Find(name));
    for (const auto& [key, n] : s.key_pushes) {
      EXPECT_EQ(n, static_cast<uint64_t>(kWorkers * rounds))
          << name << " key " << key << "\n"
          << c.AllLogs();
      ++holders[key];
    }
    duplicates += s.duplicates;
  }
  EXPECT_EQ(holders[3], 1) << "key 3 lives on one server";
  EXPECT_EQ(holders[99], kServers) << "key 99 is split over every server";
  return duplicates;
}

TEST(FaultTest, DroppedRequestsAndAcknowledgementsAreResentAndAppliedOnce) {
  const int rounds = 20;
  const std::string want = FaultFreeChecksum(rounds);
  ProcessCluster c;
  CommonEnv(c);
  // Every node drops 10% of the data messages it receives: requests on the
  // servers, replies and acknowledgements on the workers.
  c.Env("PS_DROP_MSG", "10");
  c.Start(kServers, kWorkers, {Worker(), "soak", std::to_string(rounds)});
  ExpectAllExitZero(c, absl::Seconds(180));
  const uint64_t duplicates =
      ExpectExactlyOnce(c, want, rounds, {"server 0", "server 1"});
  // With about 240 messages each way, 10% lost: resent pushes reached a server
  // that had already applied (or was holding) them.
  EXPECT_GT(duplicates, 0u) << c.AllLogs();
}

TEST(FaultTest, AsyncAppliesEveryPushOnceDespiteDrops) {
  ProcessCluster c;
  c.Env("PS_DROP_MSG", "10");
  c.Env("PS_RESEND_TIMEOUT", "50");
  c.Start(kServers, 3, {Worker(), "async"});
  // The async check: after every push and a barrier, the value is the initial
  // one plus every update, each applied once.
  ExpectAllExitZero(c, absl::Seconds(180));
}

TEST(FaultTest, UnansweredRequestFailsAfterBoundedRetriesNamingTheServer) {
  ProcessCluster c;
  CommonEnv(c);
  c.Env("PS_HEARTBEAT_TIMEOUT", "120");  // the resend limit must come first
  c.Env("PS_RESEND_TIMEOUT", "100");
  c.Env("TESSERA_RESEND_RETRIES", "3");
  c.Start(1, 1, {Worker(), "soak", "100000", "10"});
  absl::SleepFor(absl::Seconds(1));
  const pid_t server = c.Find("server 0").pid;
  kill(server, SIGSTOP);
  const absl::Time stopped = absl::Now();
  Child& worker = c.Find("worker 0");
  ASSERT_TRUE(c.Wait(worker, absl::Seconds(30))) << c.AllLogs();
  // 3 sends 100 ms, 200 ms and 400 ms apart, then the error.
  EXPECT_LT(absl::Now() - stopped, absl::Seconds(10));
  EXPECT_EQ(ProcessCluster::ExitCode(worker), 1) << c.AllLogs();
  const std::string log = ProcessCluster::Log(worker);
  EXPECT_THAT(log, HasSubstr("no answer from server 0 (id 8 at 127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("after 3 sends over"));
  EXPECT_THAT(log, HasSubstr("TESSERA_RESEND_RETRIES=3"));
  kill(server, SIGCONT);
}

std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir() + "/tessera-ckpt-XXXXXX";
  char* made = mkdtemp(tmpl.data());
  return made == nullptr ? "" : std::string(made);
}

// Whether `dir` holds a checkpoint of every server rank below `servers`.
bool EveryServerCheckpointed(const std::string& dir, int servers) {
  std::set<std::string> ranks;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".ckpt"))
      ranks.insert(name.substr(0, name.find('-', 7)));
  }
  for (int rank = 0; rank < servers; ++rank)
    if (!ranks.contains(absl::StrCat("server-", rank))) return false;
  return true;
}

// Starts scheduler, two servers on fixed ports (a restarted server rejoins by
// its address) writing checkpoints, and two soak workers; SIGKILLs "server 1"
// after `kill_after` (and, when `wait_for_checkpoints`, once every server has
// written one), restarts it, and checks the job against the fault-free
// checksum.
void KillAndRestartServer(const std::string& checkpoint_every,
                          absl::Duration kill_after, bool wait_for_checkpoints,
                          const std::string& expect_in_log) {
  const int rounds = 60;
  const std::string want = FaultFreeChecksum(rounds);
  const std::string dir = MakeTempDir();
  ASSERT_FALSE(dir.empty());
  ProcessCluster c;
  CommonEnv(c);
  c.Env("DMLC_NUM_SERVER", std::to_string(kServers));
  c.Env("DMLC_NUM_WORKER", std::to_string(kWorkers));
  const std::vector<std::string> server_argv = {
      BinaryPath("server/tessera-server"),
      "--checkpoint-dir",
      dir,
      "--checkpoint-every",
      checkpoint_every,
      "--checkpoint-keep",
      "2"};
  const int ports[kServers] = {FreePort(), FreePort()};
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"}});
  for (int i = 0; i < kServers; ++i) {
    c.Spawn(absl::StrCat("server ", i), server_argv,
            {{"DMLC_ROLE", "server"}, {"PORT", std::to_string(ports[i])}});
  }
  for (int i = 0; i < kWorkers; ++i) {
    c.Spawn(absl::StrCat("worker ", i), {Worker(), "soak", "60", "20"},
            {{"DMLC_ROLE", "worker"}});
  }
  absl::SleepFor(kill_after);
  if (wait_for_checkpoints) {
    // A loaded machine can start the job slowly; the kill must come after a
    // checkpoint for this case to test resuming from one.
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (!EveryServerCheckpointed(dir, kServers) && absl::Now() < deadline)
      absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(EveryServerCheckpointed(dir, kServers)) << c.AllLogs();
  }
  const pid_t victim = c.Find("server 1").pid;
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  ASSERT_TRUE(c.Wait(c.Find("server 1"), absl::Seconds(10)));
  c.Spawn("server 1 restarted", server_argv,
          {{"DMLC_ROLE", "server"},
           {"PORT", std::to_string(ports[1])},
           {"TESSERA_RESTART_COUNT", "1"}});
  ASSERT_TRUE(c.WaitAll(absl::Seconds(180))) << c.AllLogs();
  for (const Child& child : c.children()) {
    if (child.name == "server 1") continue;  // SIGKILLed
    EXPECT_EQ(ProcessCluster::ExitCode(child), 0) << child.name << "\n"
                                                  << c.AllLogs();
  }
  EXPECT_THAT(ProcessCluster::Log(c.Find("server 1 restarted")),
              HasSubstr(expect_in_log));
  for (int w = 0; w < kWorkers; ++w) {
    const std::string log =
        ProcessCluster::Log(c.Find(absl::StrCat("worker ", w)));
    EXPECT_EQ(Checksum(log), want) << c.AllLogs();
  }
  // The surviving server applied every push once.
  const ServerSummary s = Summary(ProcessCluster::Log(c.Find("server 0")));
  ASSERT_TRUE(s.found) << c.AllLogs();
  for (const auto& [key, n] : s.key_pushes)
    EXPECT_EQ(n, static_cast<uint64_t>(kWorkers * rounds)) << "key " << key;
  // The restarted one: restored counts plus replayed and new pushes, each
  // counted once.
  const ServerSummary r =
      Summary(ProcessCluster::Log(c.Find("server 1 restarted")));
  ASSERT_TRUE(r.found) << c.AllLogs();
  for (const auto& [key, n] : r.key_pushes)
    EXPECT_EQ(n, static_cast<uint64_t>(kWorkers * rounds)) << "key " << key;
  (void)system(absl::StrCat("rm -rf '", dir, "'").c_str());
}

TEST(FaultTest, KilledServerResumesFromItsCheckpointAndWorkersReplay) {
  KillAndRestartServer("5", absl::Milliseconds(300),
                       /*wait_for_checkpoints=*/true,
                       "resumed from checkpoint");
}

TEST(FaultTest, KilledServerWithoutACheckpointYetGetsEverythingReplayed) {
  KillAndRestartServer("100000", absl::Milliseconds(600),
                       /*wait_for_checkpoints=*/false, "no checkpoint in");
}

// Every checkpoint write takes 4 s (TESSERA_TEST_CHECKPOINT_DELAY), twice the
// heartbeat time-out. Written on the network thread, one write would stall
// heartbeats and pushes and the server would be declared dead; on the
// checkpoint thread the job goes on, every push applied once, and checkpoints
// land on disk.
TEST(FaultTest, SlowCheckpointStallsNeitherPushesNorHeartbeats) {
  const int rounds = 60;
  const std::string want = FaultFreeChecksum(rounds);
  const std::string dir = MakeTempDir();
  ASSERT_FALSE(dir.empty());
  ProcessCluster c;
  CommonEnv(c);
  c.Env("PS_HEARTBEAT_INTERVAL", "0.2");
  c.Env("PS_HEARTBEAT_TIMEOUT", "2");
  c.Env("DMLC_NUM_SERVER", std::to_string(kServers));
  c.Env("DMLC_NUM_WORKER", std::to_string(kWorkers));
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"}});
  for (int i = 0; i < kServers; ++i) {
    c.Spawn(absl::StrCat("server ", i),
            {BinaryPath("server/tessera-server"), "--checkpoint-dir", dir,
             "--checkpoint-every", "1"},
            {{"DMLC_ROLE", "server"}, {"TESSERA_TEST_CHECKPOINT_DELAY", "4"}});
  }
  for (int i = 0; i < kWorkers; ++i) {
    c.Spawn(absl::StrCat("worker ", i),
            {Worker(), "soak", std::to_string(rounds), "100"},
            {{"DMLC_ROLE", "worker"}});
  }
  ExpectAllExitZero(c, absl::Seconds(180));
  ExpectExactlyOnce(c, want, rounds, {"server 0", "server 1"});
  EXPECT_TRUE(EveryServerCheckpointed(dir, kServers)) << c.AllLogs();
  (void)system(absl::StrCat("rm -rf '", dir, "'").c_str());
}

TEST(FaultTest, RestartWithoutCheckpointDirExitsOneSayingWhy) {
  ProcessCluster c;
  c.Env("DMLC_NUM_SERVER", "1");
  c.Env("DMLC_NUM_WORKER", "1");
  c.Env("TESSERA_START_TIMEOUT", "5");
  c.Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
          {{"DMLC_ROLE", "scheduler"}});
  c.Spawn("server 0", {BinaryPath("server/tessera-server")},
          {{"DMLC_ROLE", "server"}, {"TESSERA_RESTART_COUNT", "1"}});
  c.Spawn("worker 0", {Worker(), "barrier", "1"}, {{"DMLC_ROLE", "worker"}});
  Child& server = c.Find("server 0");
  ASSERT_TRUE(c.Wait(server, absl::Seconds(30))) << c.AllLogs();
  EXPECT_EQ(ProcessCluster::ExitCode(server), 1);
  EXPECT_THAT(ProcessCluster::Log(server),
              HasSubstr("restarted (TESSERA_RESTART_COUNT=1) without "
                        "--checkpoint-dir: this server's weights are lost"));
}

TEST(FaultTest, BadCheckpointFlagsExitTwoNamingTheFlag) {
  ProcessCluster c;
  c.Env("DMLC_NUM_SERVER", "1");
  c.Env("DMLC_NUM_WORKER", "1");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--checkpoint-every", "often"},
       "--checkpoint-every='often': expected a number of updates (e.g. 100) "
       "or of seconds (e.g. 30s), greater than 0"},
      {{"--checkpoint-keep=0"},
       "--checkpoint-keep='0': expected a whole number in 1..1000"},
      {{"--checkpoint-dir"}, "--checkpoint-dir needs a value"},
      {{"--frobnicate"}, "unknown flag '--frobnicate'"},
  };
  int i = 0;
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> argv = {BinaryPath("server/tessera-server")};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const std::string name = absl::StrCat("server ", i++);
    c.Spawn(name, argv, {{"DMLC_ROLE", "server"}});
    Child& child = c.Find(name);
    ASSERT_TRUE(c.Wait(child, absl::Seconds(10))) << c.AllLogs();
    EXPECT_EQ(ProcessCluster::ExitCode(child), 2) << name;
    EXPECT_THAT(ProcessCluster::Log(child), HasSubstr(message));
  }
}

}  // namespace
}  // namespace tessera::testing
