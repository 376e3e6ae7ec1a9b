// tessera-worker's command-line errors: one line on stderr naming the flag,
// exit 2, before the process tries to join a cluster.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include "common/gpu/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/trainer/blas_core.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::StartsWith;

struct Result {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// TESSERA_BLAS_AUTO=0: the exact lines below do not depend on the kernels
// the machine's OpenBLAS picks (BlasKernelsTest sets it back).
Result RunWorker(const std::string& env_and_args) {
  const std::string command =
      "env -u DMLC_ROLE -u OPENBLAS_CORETYPE TESSERA_BLAS_AUTO=0 " +
      env_and_args + " 2>&1";
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

// OpenBLAS fell back to kernels below what the CPU has (pretended with
// TESSERA_TEST_BLAS_CORENAME, as Debian's 0.3.21 does on CPUs newer than it):
// the worker starts itself again with better ones, checks them, says so in
// one line and goes on (here to the missing data's error).
TEST(BlasKernelsTest, AFallbackCoreIsReplacedAndSaidInOneLine) {
  const CpuFeatures cpu = DetectCpuFeatures();
  if (!cpu.avx2_fma) GTEST_SKIP() << "no AVX2: no better kernels to choose";
  const std::string better = cpu.avx512 ? "SkylakeX" : "Haswell";
  const Result r =
      RunWorker("TESSERA_BLAS_AUTO=1 TESSERA_TEST_BLAS_CORENAME=Prescott " +
                kWorker + " --data /nonexistent/fmnist --device cpu");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output,
              StartsWith("tessera-worker: OpenBLAS chose its 'Prescott' "
                         "kernels for family "));
  EXPECT_THAT(r.output, HasSubstr("; using '" + better +
                                  "' (checked against a reference product"));
  EXPECT_THAT(r.output, HasSubstr("\ntessera-worker: --data: expected"));
}

// Kernels that fail the reference product are never used: the worker goes
// back to the library's own choice, saying so.
TEST(BlasKernelsTest, KernelsThatComputeWrongAreNotUsed) {
  if (!DetectCpuFeatures().avx2_fma) GTEST_SKIP() << "no AVX2";
  const Result r = RunWorker(
      "TESSERA_BLAS_AUTO=1 TESSERA_TEST_BLAS_CORENAME=Prescott "
      "TESSERA_TEST_BLAS_WRONG=1 " +
      kWorker + " --data /nonexistent/fmnist --device cpu");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, MatchesRegex("tessera-worker: OpenBLAS's '[A-Za-z]+' "
                                     "kernels computed a wrong product on "
                                     "family [0-9]+ model [0-9]+ \\(relative "
                                     "error 1\\); keeping the library's own "
                                     "'Prescott'\ntessera-worker: --data: "
                                     "expected (.|\n)*"));
}

// A user's OPENBLAS_CORETYPE is theirs: nothing is said or changed.
TEST(BlasKernelsTest, TheUsersCoreTypeIsKept) {
  const Result r = RunWorker(
      "TESSERA_BLAS_AUTO=1 TESSERA_TEST_BLAS_CORENAME=Prescott "
      "OPENBLAS_CORETYPE=Haswell " +
      kWorker + " --data /nonexistent/fmnist --device cpu");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, StartsWith("tessera-worker: --data: expected"));
}

TEST(TesseraWorkerCliTest, BadFlagIsOneLineAndExit2) {
  const Result r = RunWorker(kWorker + " --batch-size=abc");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(
      r.output,
      "tessera-worker: --batch-size: expected a positive integer, got 'abc'\n");
}

TEST(TesseraWorkerCliTest, BadWaitPullsIsOneLineAndExit2) {
  Result r = RunWorker(kWorker + " --wait-pulls sometimes");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output,
            "tessera-worker: --wait-pulls: expected layer or step, got "
            "'sometimes'\n");
  r = RunWorker(kWorker + " --fuse-keys on --wait-pulls layer");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, StartsWith("tessera-worker: --wait-pulls: layer needs "
                                   "a key per tensor, not --fuse-keys on"));
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

// dist_ssp (issue #49): a bad or missing bound, before joining a cluster.
TEST(TesseraWorkerCliTest, DistSspNeedsAGoodBound) {
  Result r = RunWorker(kWorker + " --kv-store dist_ssp --staleness -1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output,
            "tessera-worker: --staleness: expected a whole number of steps in "
            "0..1000000, got '-1'\n");
  r = RunWorker("env -u TESSERA_STALENESS " + kWorker + " --kv-store dist_ssp");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output,
            "tessera-worker: --kv-store dist_ssp: expected --staleness S (or "
            "TESSERA_STALENESS=S), a bound in steps 0..1000000\n");
}

TEST(TesseraWorkerCliTest, HelpExits0) {
  const Result r = RunWorker(kWorker + " --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.output, StartsWith("Usage: tessera-worker"));
}

}  // namespace
}  // namespace tessera
