#include "common/options.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/daemon.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

std::map<std::string, std::string> Base() {
  return {{"DMLC_ROLE", "worker"},
          {"DMLC_PS_ROOT_URI", "127.0.0.1"},
          {"DMLC_PS_ROOT_PORT", "9000"},
          {"DMLC_NUM_SERVER", "2"},
          {"DMLC_NUM_WORKER", "3"}};
}

absl::StatusOr<Options> Parse(const std::map<std::string, std::string>& env) {
  return ParseOptions(
      [&env](const std::string& name) -> std::optional<std::string> {
        auto it = env.find(name);
        if (it == env.end()) return std::nullopt;
        return it->second;
      });
}

TEST(OptionsTest, ReadsEveryVariable) {
  auto env = Base();
  env["DMLC_INTERFACE"] = "eth1";
  env["DMLC_NODE_HOST"] = "node-7";
  env["PORT"] = "4567";
  env["DMLC_TASK_ID"] = "4";
  env["TESSERA_SEALED_PORT"] = "4568";
  env["PS_VERBOSE"] = "2";
  env["PS_HEARTBEAT_INTERVAL"] = "0.5";
  env["PS_HEARTBEAT_TIMEOUT"] = "4";
  env["TESSERA_START_TIMEOUT"] = "7";
  env["TESSERA_TIMEOUT"] = "30";
  env["TESSERA_SERVER_THREADS"] = "3";
  env["TESSERA_BIGARRAY_BOUND"] = "1000";
  env["TESSERA_RESTART_COUNT"] = "2";
  env["PS_RESEND"] = "0";
  env["PS_RESEND_TIMEOUT"] = "250";
  env["TESSERA_RESEND_RETRIES"] = "3";
  env["PS_DROP_MSG"] = "20";
  env["TESSERA_MAX_MESSAGE_BYTES"] = "2097152";
  absl::StatusOr<Options> o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->role, Role::kWorker);
  EXPECT_EQ(o->root_uri, "127.0.0.1");
  EXPECT_EQ(o->root_port, 9000);
  EXPECT_EQ(o->num_servers, 2);
  EXPECT_EQ(o->num_workers, 3);
  EXPECT_EQ(o->interface, "eth1");
  EXPECT_EQ(o->node_host, "node-7");
  EXPECT_EQ(o->port, 4567);
  EXPECT_EQ(o->task_id, 4);
  EXPECT_EQ(o->sealed_port, 4568);
  EXPECT_EQ(o->verbose, 2);
  EXPECT_EQ(o->heartbeat_interval, absl::Milliseconds(500));
  EXPECT_EQ(o->heartbeat_timeout, absl::Seconds(4));
  EXPECT_EQ(o->start_timeout, absl::Seconds(7));
  EXPECT_EQ(o->request_timeout, absl::Seconds(30));
  EXPECT_EQ(o->server_threads, 3);
  EXPECT_EQ(o->bigarray_bound, 1000u);
  EXPECT_EQ(o->restart_count, 2u);
  EXPECT_FALSE(o->resend);
  EXPECT_EQ(o->resend_timeout, absl::Milliseconds(250));
  EXPECT_EQ(o->resend_retries, 3);
  EXPECT_EQ(o->drop_percent, 20);
  EXPECT_EQ(o->max_frame_bytes, 2097152);
}

TEST(OptionsTest, ElasticBoundsAreReadAndChecked) {
  auto env = Base();
  absl::StatusOr<Options> o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->elastic());
  env["TESSERA_ELASTIC"] = "2:3";
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->elastic());
  EXPECT_EQ(o->elastic_min, 2);
  EXPECT_EQ(o->elastic_max, 3);
  env["TESSERA_ELASTIC"] = "3:8";
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->elastic_max, 8);
  for (const char* bad :
       {"0:3", "4:5", "2:2", "2", "x:3", "1:3:5", "1:100001"}) {
    env["TESSERA_ELASTIC"] = bad;
    o = Parse(env);
    ASSERT_FALSE(o.ok()) << bad;
    EXPECT_EQ(o.status().message(),
              absl::StrCat("TESSERA_ELASTIC='", bad,
                           "': expected MIN:MAX, whole numbers with 1 <= MIN "
                           "<= DMLC_NUM_WORKER (3) <= MAX <= 100000"));
  }
}

TEST(OptionsTest, MaxServersAreRanksOfAReplicatedJobFormedWithFewer) {
  auto env = Base();  // DMLC_NUM_SERVER=2
  absl::StatusOr<Options> o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->num_servers, 2);
  EXPECT_EQ(o->servers_at_start(), 2);
  env["TESSERA_REPLICAS"] = "2";
  env["TESSERA_MAX_SERVERS"] = "4";
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->num_servers, 4);  // the partition's ranks
  EXPECT_EQ(o->servers_at_start(), 2);
  env["TESSERA_MAX_SERVERS"] = "2";  // as many as at the start: no change
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->num_servers, 2);
  EXPECT_EQ(o->servers_at_start(), 2);
  for (const char* bad : {"1", "5", "x", "3.5", "-4"}) {
    env["TESSERA_MAX_SERVERS"] = bad;
    o = Parse(env);
    ASSERT_FALSE(o.ok()) << bad;
    EXPECT_EQ(
        o.status().message(),
        absl::StrCat("TESSERA_MAX_SERVERS='", bad,
                     "': expected a whole number of server ranks from "
                     "DMLC_NUM_SERVER (2) to DMLC_NUM_SERVER x "
                     "TESSERA_REPLICAS (4): each chain of "
                     "TESSERA_REPLICAS ranks needs a server at the start"));
  }
  // One copy of each slice: any number of ranks from DMLC_NUM_SERVER on,
  // placed over every rank (the chain is the ring of them).
  env.erase("TESSERA_REPLICAS");
  env["TESSERA_MAX_SERVERS"] = "7";
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->single_copy);
  EXPECT_EQ(o->num_servers, 7);
  EXPECT_EQ(o->servers_at_start(), 2);
  EXPECT_EQ(o->replicas, 1);
  EXPECT_EQ(o->chain_length(), 7);
  env["TESSERA_MAX_SERVERS"] = "2";  // leaves only
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->chain_length(), 2);
  env["TESSERA_MAX_SERVERS"] = "1";
  o = Parse(env);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().message(),
            "TESSERA_MAX_SERVERS='1': expected a whole number of server ranks "
            "from DMLC_NUM_SERVER (2) to 256");
  env.erase("TESSERA_MAX_SERVERS");
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->single_copy);
  EXPECT_EQ(o->chain_length(), 1);
}

TEST(OptionsTest, DefaultsAreHeartbeatsOnAndSixtySecondStart) {
  absl::StatusOr<Options> o = Parse(Base());
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->port, 0);
  EXPECT_EQ(o->task_id, -1);  // DMLC_TASK_ID unset: ranked by address
  EXPECT_EQ(o->verbose, 0);
  EXPECT_GT(o->heartbeat_interval, absl::ZeroDuration());
  EXPECT_EQ(o->start_timeout, absl::Seconds(60));
  EXPECT_EQ(o->bigarray_bound, 1000000u);
  EXPECT_TRUE(o->resend);
  EXPECT_EQ(o->resend_timeout, absl::Seconds(1));
  EXPECT_EQ(o->resend_retries, 8);
  EXPECT_EQ(o->drop_percent, 0);
}

TEST(OptionsTest, MxnetBigArrayBoundIsHonoured) {
  auto env = Base();
  env["MXNET_KVSTORE_BIGARRAY_BOUND"] = "77";
  EXPECT_EQ(Parse(env)->bigarray_bound, 77u);
  env["TESSERA_BIGARRAY_BOUND"] = "88";
  EXPECT_EQ(Parse(env)->bigarray_bound, 88u);
}

TEST(OptionsTest, HeartbeatsCanBeTurnedOff) {
  auto env = Base();
  env["PS_HEARTBEAT_INTERVAL"] = "0";
  absl::StatusOr<Options> o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->heartbeat_interval, absl::ZeroDuration());
}

struct BadCase {
  std::string variable;
  std::optional<std::string> value;  // nullopt: unset
  std::string message;
};

constexpr char kJobIdExpected[] =
    "expected 1 to 64 letters, digits, '.', '_' or '-' (or leave it unset: "
    "jobs that set none share the empty id)";

class OptionsBadValueTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(OptionsBadValueTest, NamesVariableValueAndExpectation) {
  auto env = Base();
  if (GetParam().value.has_value()) {
    env[GetParam().variable] = *GetParam().value;
  } else {
    env.erase(GetParam().variable);
  }
  absl::StatusOr<Options> o = Parse(env);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(o.status().message(), GetParam().message);
}

INSTANTIATE_TEST_SUITE_P(
    All, OptionsBadValueTest,
    ::testing::Values(
        BadCase{"DMLC_ROLE", std::nullopt,
                "DMLC_ROLE is not set: expected scheduler, server or worker"},
        BadCase{"DMLC_ROLE", "master",
                "DMLC_ROLE='master': expected scheduler, server or worker"},
        BadCase{"DMLC_PS_ROOT_URI", std::nullopt,
                "DMLC_PS_ROOT_URI is not set: expected the scheduler's IP "
                "address or hostname"},
        BadCase{
            "DMLC_PS_ROOT_PORT", std::nullopt,
            "DMLC_PS_ROOT_PORT is not set: expected a port number in 1..65535"},
        BadCase{"DMLC_PS_ROOT_PORT", "0",
                "DMLC_PS_ROOT_PORT='0': expected a port number in 1..65535"},
        BadCase{"DMLC_PS_ROOT_PORT", "http",
                "DMLC_PS_ROOT_PORT='http': expected a port number in 1..65535"},
        BadCase{"DMLC_NUM_SERVER", "0",
                "DMLC_NUM_SERVER='0': expected a whole number >= 1"},
        BadCase{"DMLC_NUM_SERVER", "two",
                "DMLC_NUM_SERVER='two': expected a whole number >= 1"},
        BadCase{"DMLC_NUM_WORKER", std::nullopt,
                "DMLC_NUM_WORKER is not set: expected a whole number >= 1"},
        BadCase{"DMLC_NUM_WORKER", "-3",
                "DMLC_NUM_WORKER='-3': expected a whole number >= 1"},
        BadCase{"DMLC_NUM_WORKER", "2.5",
                "DMLC_NUM_WORKER='2.5': expected a whole number >= 1"},
        BadCase{"PORT", "99999",
                "PORT='99999': expected a port number in 0..65535"},
        BadCase{"DMLC_TASK_ID", "-1",
                "DMLC_TASK_ID='-1': expected a whole number >= 0 (the "
                "process's place in its launcher's start order)"},
        BadCase{"TESSERA_SEALED_PORT", "-1",
                "TESSERA_SEALED_PORT='-1': expected a port number in 0..65535 "
                "(0: any free port)"},
        BadCase{"PS_VERBOSE", "3", "PS_VERBOSE='3': expected 0, 1 or 2"},
        BadCase{
            "PS_HEARTBEAT_INTERVAL", "-1",
            "PS_HEARTBEAT_INTERVAL='-1': expected a number of seconds >= 0"},
        BadCase{"PS_HEARTBEAT_TIMEOUT", "0",
                "PS_HEARTBEAT_TIMEOUT='0': expected a number of seconds > 0"},
        BadCase{"PS_HEARTBEAT_TIMEOUT", "0.5",
                "PS_HEARTBEAT_TIMEOUT='0.5': expected a number of seconds "
                "greater than "
                "PS_HEARTBEAT_INTERVAL (1s)"},
        BadCase{
            "TESSERA_START_TIMEOUT", "soon",
            "TESSERA_START_TIMEOUT='soon': expected a number of seconds > 0"},
        BadCase{"TESSERA_TIMEOUT", "nan",
                "TESSERA_TIMEOUT='nan': expected a number of seconds > 0"},
        BadCase{
            "TESSERA_SERVER_THREADS", "999",
            "TESSERA_SERVER_THREADS='999': expected a whole number in 0..256"},
        BadCase{"TESSERA_BIGARRAY_BOUND", "0",
                "TESSERA_BIGARRAY_BOUND='0': expected a whole number >= 1"},
        BadCase{"PS_RESEND", "yes", "PS_RESEND='yes': expected 0 or 1"},
        BadCase{"PS_RESEND_TIMEOUT", "0",
                "PS_RESEND_TIMEOUT='0': expected a number of milliseconds in "
                "1..3600000"},
        BadCase{"TESSERA_RESEND_RETRIES", "0",
                "TESSERA_RESEND_RETRIES='0': expected a whole number in "
                "1..1000"},
        BadCase{"PS_DROP_MSG", "100",
                "PS_DROP_MSG='100': expected a percentage in 0..99"},
        BadCase{"TESSERA_MAX_MESSAGE_BYTES", "10",
                "TESSERA_MAX_MESSAGE_BYTES='10': expected a number of bytes "
                "in 1048576..2^40"},
        BadCase{"TESSERA_CHUNK_BYTES", "100",
                "TESSERA_CHUNK_BYTES='100': expected a number of bytes in "
                "4096..2^30"},
        BadCase{"TESSERA_SYNC_SUM", "fast",
                "TESSERA_SYNC_SUM='fast': expected exact or arrival"},
        BadCase{"TESSERA_STALENESS", "-1",
                "TESSERA_STALENESS='-1': expected a whole number of steps in "
                "0..1000000 (dist_ssp's staleness bound)"},
        BadCase{"TESSERA_STALENESS", "1000001",
                "TESSERA_STALENESS='1000001': expected a whole number of steps "
                "in 0..1000000 (dist_ssp's staleness bound)"},
        BadCase{"TESSERA_SEND_CREDIT_BYTES", "-1",
                "TESSERA_SEND_CREDIT_BYTES='-1': expected a number of bytes in "
                "0..1073741824 (0: the kernel's own socket buffers)"},
        BadCase{"TESSERA_SEND_CREDIT_BYTES", "1m",
                "TESSERA_SEND_CREDIT_BYTES='1m': expected a number of bytes in "
                "0..1073741824 (0: the kernel's own socket buffers)"},
        BadCase{"TESSERA_LATE_FACTOR", "0.5",
                "TESSERA_LATE_FACTOR='0.5': expected a number in 1..1000000"},
        BadCase{"TESSERA_LATE_FACTOR", "ten",
                "TESSERA_LATE_FACTOR='ten': expected a number in 1..1000000"},
        BadCase{"TESSERA_LATE_MIN", "0",
                "TESSERA_LATE_MIN='0': expected a number of seconds > 0"},
        BadCase{"TESSERA_JOB_ID", "my job",
                std::string("TESSERA_JOB_ID='my job': ") + kJobIdExpected},
        BadCase{"TESSERA_JOB_ID", std::string(65, 'a'),
                absl::StrCat("TESSERA_JOB_ID='", std::string(65, 'a'),
                             "': ", kJobIdExpected)}));

// Issue #46: the job id that sealed links bind (empty when unset).
TEST(OptionsTest, AJobIdIsReadAsItIsAndEmptyWhenUnset) {
  auto env = Base();
  EXPECT_EQ(Parse(env)->job_id, "");
  env["TESSERA_JOB_ID"] = "";  // set but empty: as unset
  EXPECT_EQ(Parse(env)->job_id, "");
  env["TESSERA_JOB_ID"] = "train-2026.11_29";
  EXPECT_EQ(Parse(env)->job_id, "train-2026.11_29");
  env["TESSERA_JOB_ID"] = std::string(64, 'z');
  EXPECT_EQ(Parse(env)->job_id, std::string(64, 'z'));
}

TEST(OptionsTest, ChunksAndExactSumsByDefaultAndBothCanBeChanged) {
  std::map<std::string, std::string> env = {{"DMLC_ROLE", "server"},
                                            {"DMLC_PS_ROOT_URI", "127.0.0.1"},
                                            {"DMLC_PS_ROOT_PORT", "9000"},
                                            {"DMLC_NUM_SERVER", "1"},
                                            {"DMLC_NUM_WORKER", "1"}};
  absl::StatusOr<Options> o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->chunk_bytes, 1 << 20);
  EXPECT_EQ(o->max_frame_bytes, int64_t{1} << 30);
  EXPECT_TRUE(o->exact_sync_sum);
  EXPECT_EQ(o->late_factor, 10);
  EXPECT_EQ(o->late_min, absl::Seconds(1));
  EXPECT_EQ(o->staleness, -1) << "unset";
  EXPECT_EQ(o->send_credit_bytes, 0) << "the kernel's own buffers";
  env["TESSERA_SEND_CREDIT_BYTES"] = "1048576";
  EXPECT_EQ(Parse(env)->send_credit_bytes, 1 << 20);
  env["TESSERA_SEND_CREDIT_BYTES"] = "262144";
  EXPECT_EQ(Parse(env)->send_credit_bytes, 262144);
  env.erase("TESSERA_SEND_CREDIT_BYTES");
  env["TESSERA_STALENESS"] = "0";
  EXPECT_EQ(Parse(env)->staleness, 0);
  env["TESSERA_STALENESS"] = "1000000";
  EXPECT_EQ(Parse(env)->staleness, 1000000);
  env["TESSERA_CHUNK_BYTES"] = "65536";
  env["TESSERA_SYNC_SUM"] = "arrival";
  env["TESSERA_LATE_FACTOR"] = "4.5";
  env["TESSERA_LATE_MIN"] = "0.25";
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->chunk_bytes, 65536);
  EXPECT_FALSE(o->exact_sync_sum);
  EXPECT_EQ(o->late_factor, 4.5);
  EXPECT_EQ(o->late_min, absl::Milliseconds(250));
}

// Arrival-order sums and three or more replicas of a slice could leave two
// backups with different sums of one round after a fail-over (issue #46):
// refused, naming both variables; two replicas or exact sums are taken.
TEST(OptionsTest, ArrivalSumsWithMoreThanTwoReplicasAreRefused) {
  std::map<std::string, std::string> env = {
      {"DMLC_ROLE", "server"},       {"DMLC_PS_ROOT_URI", "127.0.0.1"},
      {"DMLC_PS_ROOT_PORT", "9000"}, {"DMLC_NUM_SERVER", "3"},
      {"DMLC_NUM_WORKER", "1"},      {"TESSERA_SYNC_SUM", "arrival"},
      {"TESSERA_REPLICAS", "3"}};
  absl::StatusOr<Options> o = Parse(env);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(o.status().message(),
            "TESSERA_SYNC_SUM=arrival with TESSERA_REPLICAS=3: arrival-order "
            "sums allow at most 2 replicas (after a primary's death its "
            "backups could keep different sums of the same round); use "
            "TESSERA_SYNC_SUM=exact (the default) or TESSERA_REPLICAS=2");
  env["TESSERA_REPLICAS"] = "2";
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->exact_sync_sum);
  EXPECT_EQ(o->replicas, 2);
  env["TESSERA_REPLICAS"] = "3";
  env["TESSERA_SYNC_SUM"] = "exact";
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->replicas, 3);
}

// A daemon is not dumpable (no core dump with its keys, no ptrace by its
// user) unless TESSERA_CORE_DUMPS=1 (issue #46). StartDaemon runs in a child
// process, which exits with what prctl(PR_GET_DUMPABLE) says then.
int DumpableAfterStartDaemon(const char* core_dumps) {
  const pid_t child = fork();
  if (child == 0) {
    setenv("DMLC_ROLE", "scheduler", 1);
    setenv("DMLC_PS_ROOT_URI", "127.0.0.1", 1);
    setenv("DMLC_PS_ROOT_PORT", "9000", 1);
    setenv("DMLC_NUM_SERVER", "1", 1);
    setenv("DMLC_NUM_WORKER", "1", 1);
    if (core_dumps == nullptr) {
      unsetenv("TESSERA_CORE_DUMPS");
    } else {
      setenv("TESSERA_CORE_DUMPS", core_dumps, 1);
    }
    absl::StatusOr<Options> o = StartDaemon(Role::kScheduler);
    if (!o.ok()) _exit(10);
    _exit(prctl(PR_GET_DUMPABLE, 0, 0, 0, 0));
  }
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status))
    return -1;
  return WEXITSTATUS(status);
}

TEST(OptionsTest, DaemonsAreNotDumpableUnlessCoreDumpsAreAskedFor) {
  EXPECT_EQ(DumpableAfterStartDaemon(nullptr), 0);
  EXPECT_EQ(DumpableAfterStartDaemon("0"), 0);
  EXPECT_EQ(DumpableAfterStartDaemon("1"), 1);
  EXPECT_EQ(DumpableAfterStartDaemon("yes"), 10);  // a bad value: an error
  auto env = Base();
  env["TESSERA_CORE_DUMPS"] = "yes";
  absl::StatusOr<Options> o = Parse(env);
  ASSERT_FALSE(o.ok());
  EXPECT_THAT(std::string(o.status().message()),
              HasSubstr("TESSERA_CORE_DUMPS='yes': expected 0 or 1"));
}

TEST(OptionsTest, SecurityIsOnUnlessTurnedOffAndKeysAreNamed) {
  absl::StatusOr<Options> o = Parse(Base());
  ASSERT_TRUE(o.ok());
  EXPECT_FALSE(o->insecure);
  EXPECT_FALSE(o->auth_only);
  EXPECT_EQ(o->key_file, "");
  EXPECT_EQ(o->key_dir, "");
  auto env = Base();
  env["TESSERA_KEY_FILE"] = " /run/job/worker.key ";
  env["TESSERA_KEY_DIR"] = "/run/job";
  env["TESSERA_AUTH_ONLY"] = "1";
  o = Parse(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->key_file, "/run/job/worker.key");
  EXPECT_EQ(o->key_dir, "/run/job");
  EXPECT_TRUE(o->auth_only);
  env = Base();
  env["TESSERA_INSECURE"] = "1";
  o = Parse(env);
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->insecure);
  env["TESSERA_INSECURE"] = "yes";
  EXPECT_THAT(Parse(env).status().message(),
              HasSubstr("TESSERA_INSECURE='yes': expected 0 or 1"));
  env["TESSERA_INSECURE"] = "1";
  env["TESSERA_AUTH_ONLY"] = "1";
  EXPECT_THAT(Parse(env).status().message(),
              HasSubstr("TESSERA_AUTH_ONLY='1': expected 0 when "
                        "TESSERA_INSECURE=1"));
}

}  // namespace
}  // namespace tessera
