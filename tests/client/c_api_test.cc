// The C API's results through libtessera.so (as installed programs link it):
// a failure returns its status code (TesseraStatusCode, absl::StatusCode's
// values), not a bare non-zero, and tessera_last_error() names it; the C++
// API's KVWorker::Create is reached through the same library. No job: these
// are the failures that need none, and one that waits for a scheduler that
// is not there.
#include "tessera/c_api.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "tessera/kv_worker.h"

namespace {

// Sets the environment a worker reads, and clears it at the end.
class WorkerEnvironment {
 public:
  WorkerEnvironment() { Clear(); }
  ~WorkerEnvironment() { Clear(); }
  void Set(const char* name, const std::string& value) {
    setenv(name, value.c_str(), 1);
  }

 private:
  static void Clear() {
    for (const char* name :
         {"DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT",
          "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "TESSERA_START_TIMEOUT",
          "TESSERA_INSECURE", "TESSERA_STALENESS"}) {
      unsetenv(name);
    }
  }
};

// A loopback port nothing listens on (bound, then closed).
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(CApiTest, VersionIsTheProjectVersion) {
  EXPECT_STREQ(tessera_version(), TESSERA_EXPECTED_VERSION);
}

TEST(CApiTest, CallerMistakesReturnInvalidArgument) {
  TesseraKV* kv = nullptr;
  EXPECT_EQ(tessera_kv_create(nullptr, &kv), TESSERA_INVALID_ARGUMENT);
  EXPECT_STREQ(tessera_last_error(), "INVALID_ARGUMENT: type is NULL");
  EXPECT_EQ(tessera_kv_create("local", &kv), TESSERA_INVALID_ARGUMENT);
  EXPECT_STREQ(tessera_last_error(),
               "INVALID_ARGUMENT: KV store type 'local': expected dist_sync, "
               "dist_async, dist_ssp or dist_device_sync");
  EXPECT_EQ(tessera_kv_set_staleness(nullptr, 3), TESSERA_INVALID_ARGUMENT);
  EXPECT_STREQ(tessera_last_error(), "INVALID_ARGUMENT: kv is NULL");
  EXPECT_EQ(tessera_kv_set_priority(nullptr, 1, 3), TESSERA_INVALID_ARGUMENT);
  EXPECT_STREQ(tessera_last_error(), "INVALID_ARGUMENT: kv is NULL");
  EXPECT_EQ(tessera_kv_priority(nullptr, 1, nullptr), TESSERA_INVALID_ARGUMENT);
  EXPECT_STREQ(tessera_last_error(), "INVALID_ARGUMENT: kv is NULL");
  EXPECT_EQ(tessera_kv_barrier(nullptr), TESSERA_INVALID_ARGUMENT);
  EXPECT_STREQ(tessera_last_error(), "INVALID_ARGUMENT: kv is NULL");
  float grad[16] = {1.0f}, residual[16] = {0.0f}, out[16];
  uint8_t packed[4];
  EXPECT_EQ(tessera_2bit_quantize(grad, residual, 16, 0.0f, packed),
            TESSERA_INVALID_ARGUMENT);
  EXPECT_EQ(tessera_2bit_dequantize(nullptr, 16, 0.5f, out),
            TESSERA_INVALID_ARGUMENT);
  EXPECT_STREQ(tessera_last_error(), "INVALID_ARGUMENT: in is NULL");
  EXPECT_EQ(tessera_kv_init_hashed(nullptr, 1, 4, ""),
            TESSERA_INVALID_ARGUMENT);
  EXPECT_STREQ(tessera_last_error(), "INVALID_ARGUMENT: kv is NULL");
}

TEST(CApiTest, SuccessReturnsOkAndLeavesTheLastErrorAsItWas) {
  EXPECT_EQ(tessera_kv_barrier(nullptr), TESSERA_INVALID_ARGUMENT);
  float grad[16] = {0.6f, -0.7f}, residual[16] = {0.0f};
  uint8_t packed[4];
  EXPECT_EQ(tessera_2bit_quantize(grad, residual, 16, 0.5f, packed),
            TESSERA_OK);
  EXPECT_STREQ(tessera_last_error(), "INVALID_ARGUMENT: kv is NULL");
}

TEST(CApiTest, AWorkerWithoutAJobIsInvalidArgument) {
  WorkerEnvironment env;
  TesseraKV* kv = nullptr;
  EXPECT_EQ(tessera_kv_create("dist_sync", &kv), TESSERA_INVALID_ARGUMENT);
  EXPECT_STREQ(tessera_last_error(),
               "INVALID_ARGUMENT: DMLC_ROLE is not set: expected scheduler, "
               "server or worker");
}

// dist_ssp's bound from the environment: a bad one is named, with what was
// expected, before the worker joins anything (issue #49).
TEST(CApiTest, ABadStalenessVariableIsInvalidArgument) {
  WorkerEnvironment env;
  env.Set("DMLC_ROLE", "worker");
  env.Set("DMLC_PS_ROOT_URI", "127.0.0.1");
  env.Set("DMLC_PS_ROOT_PORT", std::to_string(UnusedPort()));
  env.Set("DMLC_NUM_WORKER", "1");
  env.Set("DMLC_NUM_SERVER", "1");
  for (const char* bad : {"-1", "three", "1000001", "2.5"}) {
    env.Set("TESSERA_STALENESS", bad);
    TesseraKV* kv = nullptr;
    EXPECT_EQ(tessera_kv_create("dist_ssp", &kv), TESSERA_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(tessera_last_error()),
              std::string("INVALID_ARGUMENT: TESSERA_STALENESS='") + bad +
                  "': expected a whole number of steps in 0..1000000 "
                  "(dist_ssp's staleness bound)");
  }
}

// Not every failure is a caller's mistake: a worker whose scheduler never
// answers gives up at TESSERA_START_TIMEOUT (+1 s) with DeadlineExceeded.
TEST(CApiTest, AWorkerWithNoSchedulerIsDeadlineExceeded) {
  WorkerEnvironment env;
  env.Set("DMLC_ROLE", "worker");
  env.Set("DMLC_PS_ROOT_URI", "127.0.0.1");
  env.Set("DMLC_PS_ROOT_PORT", std::to_string(UnusedPort()));
  env.Set("DMLC_NUM_WORKER", "1");
  env.Set("DMLC_NUM_SERVER", "1");
  env.Set("TESSERA_START_TIMEOUT", "1");
  env.Set("TESSERA_INSECURE", "1");
  TesseraKV* kv = nullptr;
  EXPECT_EQ(tessera_kv_create("dist_sync", &kv), TESSERA_DEADLINE_EXCEEDED)
      << tessera_last_error();
  EXPECT_EQ(std::string(tessera_last_error()).rfind("DEADLINE_EXCEEDED: ", 0),
            0u)
      << tessera_last_error();
}

// The C++ API from the same library: its failures are absl::Status.
TEST(CApiTest, TheCppApiIsExportedToo) {
  WorkerEnvironment env;
  absl::StatusOr<std::unique_ptr<tessera::KVWorker>> kv =
      tessera::KVWorker::Create("dist_sync");
  ASSERT_FALSE(kv.ok());
  EXPECT_EQ(kv.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(static_cast<int>(kv.status().code()), TESSERA_INVALID_ARGUMENT);
}

}  // namespace
