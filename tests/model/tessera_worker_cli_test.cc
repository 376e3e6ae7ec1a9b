// tessera-worker's command-line errors: one line on stderr naming the flag,
// exit 2, before the process tries to join a cluster.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include "common/gpu/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::StartsWith;

struct Result {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

Result RunWorker(const std::string& env_and_args) {
  const std::string command = "env -u DMLC_ROLE " + env_and_args + " 2>&1";
  Result r;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0)
    r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

const std::string kWorker = TESSERA_WORKER_BIN;

TEST(TesseraWorkerCliTest, BadFlagIsOneLineAndExit2) {
  const Result r = RunWorker(kWorker + " --batch-size=abc");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(
      r.output,
      "tessera-worker: --batch-size: expected a positive integer, got 'abc'\n");
}

TEST(TesseraWorkerCliTest, UnknownFlagIsOneLineAndExit2) {
  const Result r = RunWorker(kWorker + " --num-epochs 3");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output,
            "tessera-worker: unknown flag '--num-epochs'; run tessera-worker "
            "--help for "
            "the flags\n");
}

TEST(TesseraWorkerCliTest, MissingDataIsOneLineAndExit2) {
  const Result r =
      RunWorker(kWorker + " --data /nonexistent/fmnist --device cpu");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output,
            "tessera-worker: --data: expected the Fashion-MNIST IDX files in "
            "'/nonexistent/fmnist' (set --data or FASHION_MNIST_DIR): "
            "/nonexistent/fmnist/train-images-idx3-ubyte.gz: cannot open: No "
            "such file "
            "or directory\n");
}

TEST(TesseraWorkerCliTest, DataDirectoryComesFromTheEnvironment) {
  const Result r = RunWorker("FASHION_MNIST_DIR=/nonexistent/env " + kWorker +
                             " --device cpu");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output,
              StartsWith("tessera-worker: --data: expected the Fashion-MNIST "
                         "IDX files in '/nonexistent/env'"));
}

TEST(TesseraWorkerCliTest, CudaWithoutDeviceIsExit2) {
  if (gpu::DeviceAvailable()) GTEST_SKIP() << "a CUDA device is present";
  const Result r = RunWorker(kWorker + " --device cuda");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output,
              StartsWith("tessera-worker: --device: expected a usable GPU"));
}

TEST(TesseraWorkerCliTest, HelpExits0) {
  const Result r = RunWorker(kWorker + " --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.output, StartsWith("Usage: tessera-worker"));
}

}  // namespace
}  // namespace tessera
