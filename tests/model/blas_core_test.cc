// BlasCore: which OpenBLAS kernels are worth replacing, and the reference
// product that every kernel must pass.
#include "worker/trainer/blas_core.h"

#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace tessera {
namespace {

TEST(BlasCoreTest, FallbackCoresAreReplacedByWhatTheCpuHas) {
  const CpuFeatures avx512{true, true}, avx2{true, false}, old{false, false};
  EXPECT_EQ(BetterCoreType("Prescott", avx512), "SkylakeX");
  EXPECT_EQ(BetterCoreType("Prescott", avx2), "Haswell");
  EXPECT_EQ(BetterCoreType("Prescott", old), "");
  EXPECT_EQ(BetterCoreType("Sandybridge", avx512), "SkylakeX");
  EXPECT_EQ(BetterCoreType("Nehalem", avx2), "Haswell");
  // Chosen on purpose by the library, or not x86: left alone.
  EXPECT_EQ(BetterCoreType("Haswell", avx512), "");
  EXPECT_EQ(BetterCoreType("SkylakeX", avx512), "");
  EXPECT_EQ(BetterCoreType("Zen", avx512), "");
  EXPECT_EQ(BetterCoreType("ARMV8", avx512), "");
  EXPECT_EQ(BetterCoreType("", avx512), "");
}

TEST(BlasCoreTest, FeaturesAgreeWithTheKernelsCpuFlags) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line) && line.rfind("flags", 0) != 0) {
  }
  if (line.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags";
  std::istringstream words(line);
  std::string w;
  bool avx2 = false, fma = false, f = false, bw = false, dq = false, vl = false;
  while (words >> w) {
    avx2 |= w == "avx2";
    fma |= w == "fma";
    f |= w == "avx512f";
    bw |= w == "avx512bw";
    dq |= w == "avx512dq";
    vl |= w == "avx512vl";
  }
  const CpuFeatures cpu = DetectCpuFeatures();
  EXPECT_EQ(cpu.avx2_fma, avx2 && fma);
  EXPECT_EQ(cpu.avx512, avx2 && fma && f && bw && dq && vl);
}

TEST(BlasCoreTest, TheLoadedKernelsPassTheReferenceProduct) {
  // float32 sums of 61 terms: relative error a few 2^-24 at most.
  const double error = SgemmError();
  EXPECT_LT(error, 1e-5) << BlasCoreName();
  EXPECT_FALSE(BlasCoreName().empty());
}

}  // namespace
}  // namespace tessera
