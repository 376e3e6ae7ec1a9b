// dist_ssp in real jobs on loopback (issue #49): a scheduler, two servers
// and three ssp_worker processes (tests/ssp/ssp_worker.cc), whose pulled
// values say which pushes of every worker they reflect. Under random delays
// and a straggler no value misses a push of another worker numbered below
// c - s (c: the puller's clock), for s = 0, 1 and 3, nor holds one past
// c + s + 1; dist_sync's are exact; a worker that leaves an elastic job
// stops holding the others, and one that joins starts at the slowest clock,
// which outlives a killed server when the slices have two replicas;
// bad bounds fail naming what was expected.
#include <signal.h>

#include <cstdio>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/core/process_cluster.h"

namespace tessera::testing {
namespace {

constexpr int kWorkers = 3;
constexpr int kSteps = 30;

// A job whose key 0 (3000 values) is split over both servers, in slices of
// 1024 values.
void Configure(ProcessCluster& c) {
  c.Env("TESSERA_BIGARRAY_BOUND", "1000");
  c.Env("TESSERA_CHUNK_BYTES", "4096");
  c.Env("SSP_SLOW_RANK", "0");
}

std::vector<std::string> WorkerArgv(const std::string& store, int steps) {
  return {BinaryPath("tests/ssp/ssp_worker"), store, std::to_string(steps),
          "8"};
}

// Every process exited 0 within 120 s; each worker's summary, by rank.
struct Summary {
  long long checked = -1, behind = -1, ahead = -1;
};
std::vector<Summary> Finish(ProcessCluster& c) {
  EXPECT_TRUE(c.WaitAll(absl::Seconds(120))) << c.AllLogs();
  std::vector<Summary> out(kWorkers);
  const std::regex line(
      "ssp_worker rank ([0-9]+): [0-9]+ steps, ([0-9]+) values checked, most "
      "behind (-?[0-9]+), most ahead (-?[0-9]+)");
  for (const Child& child : c.children()) {
    EXPECT_EQ(ProcessCluster::ExitCode(child), 0) << child.name << "\n"
                                                  << c.AllLogs();
    const std::string log = ProcessCluster::Log(child);
    std::smatch m;
    if (!std::regex_search(log, m, line)) continue;
    const int rank = std::stoi(m[1]);
    if (rank < 0 || rank >= kWorkers) continue;
    out[rank] = {std::stoll(m[2]), std::stoll(m[3]), std::stoll(m[4])};
  }
  return out;
}

// The bound, from outside: every value of every pull in range (the worker
// exits 1 otherwise), and the most any other worker was seen behind or
// ahead within it.
void ExpectBoundHeld(int staleness, bool by_setter) {
  SCOPED_TRACE(absl::StrCat("s = ", staleness,
                            by_setter ? " (SetStaleness)" : " (env)"));
  ProcessCluster c;
  Configure(c);
  if (by_setter) {
    c.Env("SSP_SET_STALENESS", std::to_string(staleness));
  } else {
    c.Env("TESSERA_STALENESS", std::to_string(staleness));
  }
  c.Start(/*servers=*/2, kWorkers, WorkerArgv("dist_ssp", kSteps));
  const std::vector<Summary> summaries = Finish(c);
  for (int r = 0; r < kWorkers; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    std::printf("s = %d, rank %d: most behind %lld, most ahead %lld\n",
                staleness, r, summaries[r].behind, summaries[r].ahead);
    // Every value of both keys in every step.
    EXPECT_EQ(summaries[r].checked, kSteps * (kWorkers * 1000 + kWorkers));
    EXPECT_LE(summaries[r].behind, staleness);
    EXPECT_LE(summaries[r].ahead, staleness + 1);
  }
}

TEST(SspClusterTest, NoPullMissesAPushOlderThanSUnderRandomDelays) {
  ExpectBoundHeld(0, /*by_setter=*/false);
  ExpectBoundHeld(1, /*by_setter=*/true);
  ExpectBoundHeld(3, /*by_setter=*/false);
}

// The same program under dist_sync: every value is exactly the puller's
// clock (a round's sum), which dist_ssp with s = 0 does not promise.
TEST(SspClusterTest, DistSyncValuesAreExact) {
  ProcessCluster c;
  Configure(c);
  c.Start(/*servers=*/2, kWorkers, WorkerArgv("dist_sync", 10));
  for (const Summary& s : Finish(c)) {
    EXPECT_EQ(s.checked, 10 * (kWorkers * 1000 + kWorkers));
    EXPECT_EQ(s.behind, 0);
    EXPECT_EQ(s.ahead, 0);
  }
}

// Elastic job: rank 2 leaves after 4 steps; the others run 20 with s = 1,
// which they could not without the servers letting go of it.
TEST(SspClusterTest, AWorkerThatLeavesStopsHoldingTheOthers) {
  ProcessCluster c;
  Configure(c);
  c.Env("TESSERA_ELASTIC", "2:3");
  c.Env("TESSERA_STALENESS", "1");
  c.Env("SSP_LEAVE", "2:4");
  c.Start(/*servers=*/2, kWorkers, WorkerArgv("dist_ssp", 20));
  const std::vector<Summary> summaries = Finish(c);
  EXPECT_EQ(summaries[0].checked, 20 * (kWorkers * 1000 + kWorkers));
  EXPECT_EQ(summaries[1].checked, 20 * (kWorkers * 1000 + kWorkers));
  EXPECT_NE(c.AllLogs().find("ssp_worker rank 2: left after 4 steps"),
            std::string::npos)
      << c.AllLogs();
}

// Waits up to 60 s for `text` in `child`'s log.
bool LogShows(const Child& child, const std::string& text) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (ProcessCluster::Log(child).find(text) == std::string::npos) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return true;
}

// Elastic job (2 of at most 3 workers, s = 1): ranks 0 and 1 run 6 steps and
// wait; rank 2 joins then, starting every key at their clock, 6 (logged by
// the client); its pull before its first push is answered at once, with
// exactly 6 pushes of each of the others; then all run to clock 20, every
// value of every pull within the bound (the joiner's counted from 6). With
// `kill_server`, the job's slices have two replicas (TESSERA_REPLICAS=2 of 2
// servers) and server 0 is killed after the join, before the others go on:
// the survivor answers for all of them, and holds and answers the joiner's
// pulls from its clock as the dead primary did.
void ExpectJoinerStartsAtTheSlowestClock(bool kill_server) {
  SCOPED_TRACE(kill_server ? "server 0 killed after the join" : "no kill");
  constexpr int kJoinAt = 6, kTotal = 20;
  ProcessCluster c;
  Configure(c);
  const std::string resume = c.dir() + "/resume";
  c.Env("TESSERA_ELASTIC", "2:3");
  c.Env("TESSERA_STALENESS", "1");
  c.Env("SSP_WIDTH", "3");
  c.Env("SSP_JOIN", absl::StrCat("2:", kJoinAt, ":", resume));
  if (kill_server) {
    c.Env("TESSERA_REPLICAS", "2");
    c.Env("PS_HEARTBEAT_INTERVAL", "0.5");
    c.Env("PS_HEARTBEAT_TIMEOUT", "2");
  }
  c.Start(/*servers=*/2, /*workers=*/2, WorkerArgv("dist_ssp", kTotal));
  for (const char* name : {"worker 0", "worker 1"}) {
    ASSERT_TRUE(LogShows(c.Find(name), "paused after 6 steps")) << c.AllLogs();
  }
  Child& joiner = c.Spawn("worker 2", WorkerArgv("dist_ssp", kTotal),
                          {{"DMLC_ROLE", "worker"}});
  for (const char* line :
       {"joined the job (generation 1): dist_ssp key 0 starts at clock 6 "
        "(the slowest worker's)",
        "joined the job (generation 1): dist_ssp key 1 starts at clock 6 "
        "(the slowest worker's)",
        "ssp_worker rank 2: joined at clock 6, first pull exact"}) {
    ASSERT_TRUE(LogShows(joiner, line)) << line << "\n" << c.AllLogs();
  }
  if (kill_server) {
    Child& server = c.Find("server 0");
    ASSERT_EQ(::kill(server.pid, SIGKILL), 0);
    ASSERT_TRUE(c.Wait(server, absl::Seconds(10)));
  }
  std::FILE* f = std::fopen(resume.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  ASSERT_TRUE(c.WaitAll(absl::Seconds(120))) << c.AllLogs();
  const std::regex summary(
      "ssp_worker rank ([0-9]+): [0-9]+ steps, ([0-9]+) values checked, most "
      "behind (-?[0-9]+), most ahead (-?[0-9]+)");
  const long long per_step = kWorkers * 1000 + kWorkers;
  std::vector<long long> checked(kWorkers, -1);
  for (const Child& child : c.children()) {
    if (child.name == "scheduler" || child.name.rfind("server", 0) == 0)
      continue;
    EXPECT_EQ(ProcessCluster::ExitCode(child), 0) << child.name << "\n"
                                                  << c.AllLogs();
    std::smatch m;
    const std::string log = ProcessCluster::Log(child);
    ASSERT_TRUE(std::regex_search(log, m, summary)) << log;
    checked[std::stoi(m[1])] = std::stoll(m[2]);
    EXPECT_LE(std::stoll(m[3]), 1) << child.name;
    EXPECT_LE(std::stoll(m[4]), 2) << child.name;
  }
  EXPECT_EQ(checked[0], kTotal * per_step);
  EXPECT_EQ(checked[1], kTotal * per_step);
  // Its first pull and its 14 steps.
  EXPECT_EQ(checked[2], (1 + kTotal - kJoinAt) * per_step);
  if (kill_server) {
    // The killed process had either rank; the survivor took its slices.
    EXPECT_TRUE(std::regex_search(
        ProcessCluster::Log(c.Find("server 1")),
        std::regex("server\\(s\\) [01] died: this server now answers for "
                   "[1-9][0-9]* of their key slices")))
        << c.AllLogs();
    EXPECT_EQ(ProcessCluster::ExitCode(c.Find("server 1")), 0) << c.AllLogs();
    EXPECT_EQ(ProcessCluster::ExitCode(c.Find("scheduler")), 0) << c.AllLogs();
  }
}

TEST(SspClusterTest, AJoiningWorkerStartsAtTheSlowestClock) {
  ExpectJoinerStartsAtTheSlowestClock(/*kill_server=*/false);
}

// Issue #49: replicas, dist_ssp and a join in one real job.
TEST(SspClusterTest, AJoinersClockOutlivesItsPrimaryServer) {
  ExpectJoinerStartsAtTheSlowestClock(/*kill_server=*/true);
}

// A job of one server and one `store` worker with `env` set: the worker
// exits 1 within 60 s, saying `error`.
void ExpectWorkerFails(
    const std::vector<std::pair<std::string, std::string>>& env,
    const std::string& store, const std::string& error) {
  SCOPED_TRACE(error);
  ProcessCluster c;
  for (const auto& [name, value] : env) c.Env(name, value);
  c.Start(1, 1, WorkerArgv(store, 1));
  Child& w = c.Find("worker 0");
  EXPECT_TRUE(c.Wait(w, absl::Seconds(60))) << c.AllLogs();
  EXPECT_EQ(ProcessCluster::ExitCode(w), 1) << c.AllLogs();
  EXPECT_NE(ProcessCluster::Log(w).find(error), std::string::npos)
      << c.AllLogs();
}

// What a bad bound says, and the exit code.
TEST(SspClusterTest, ABadBoundIsAClearError) {
  ExpectWorkerFails(
      {{"TESSERA_STALENESS", "-2"}}, "dist_ssp",
      "ssp_worker: INVALID_ARGUMENT: TESSERA_STALENESS='-2': "
      "expected a whole number of steps in 0..1000000 (dist_ssp's "
      "staleness bound)");
  ExpectWorkerFails(
      {{"SSP_SET_STALENESS", "1000001"}}, "dist_ssp",
      "ssp_worker: INVALID_ARGUMENT: staleness 1000001: expected a "
      "whole number of steps in 0..1000000");
  // dist_ssp with no bound at all
  ExpectWorkerFails({}, "dist_ssp",
                    "ssp_worker: FAILED_PRECONDITION: dist_ssp needs a "
                    "staleness bound: set TESSERA_STALENESS or call "
                    "set_staleness before the first init");
  // a bound for a store that has none
  ExpectWorkerFails(
      {{"SSP_SET_STALENESS", "2"}}, "dist_sync",
      "ssp_worker: FAILED_PRECONDITION: set_staleness: this store "
      "is dist_sync; a staleness bound is dist_ssp's");
}

}  // namespace
}  // namespace tessera::testing
