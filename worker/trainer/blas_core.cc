#include "worker/trainer/blas_core.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define TESSERA_BLAS_X86 1
#else
#define TESSERA_BLAS_X86 0
#endif

namespace tessera {
namespace {

// Set by ChooseBlasKernels for the process it starts again: the kernels the
// library chose first ("!" after a failed check: leave everything as it is).
constexpr char kReexecVariable[] = "TESSERA_BLAS_REEXEC";

// x86 cores OpenBLAS falls back to, or that belong to CPUs without AVX2: a
// CPU with AVX2 or AVX-512 is not well served by any of them.
constexpr absl::string_view kFallbackCores[] = {
    "Prescott", "Core2",       "Penryn",       "Dunnington", "Nehalem",
    "Atom",     "Sandybridge", "Katmai",       "Coppermine", "Northwood",
    "Banias",   "Opteron",     "Opteron_SSE3", "Barcelona"};

// "family 6 model 207" of the CPU running this, from CPUID leaf 1.
std::string CpuDescription() {
#if TESSERA_BLAS_X86
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0) {
    unsigned family = (eax >> 8) & 0xf;
    unsigned model = (eax >> 4) & 0xf;
    if (family == 0xf) family += (eax >> 20) & 0xff;
    if (family == 6 || family >= 0xf) model |= ((eax >> 16) & 0xf) << 4;
    return absl::StrCat("family ", family, " model ", model);
  }
#endif
  return "this CPU";
}

std::string Features(const CpuFeatures& cpu) {
  return cpu.avx512 ? "AVX-512" : cpu.avx2_fma ? "AVX2 and FMA" : "no AVX2";
}

// Deterministic values in [-1, 1).
std::vector<float> Values(size_t n, uint32_t seed) {
  std::vector<float> out(n);
  for (float& v : out) {
    seed = seed * 1664525u + 1013904223u;
    v = static_cast<float>(seed >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  return out;
}

}  // namespace

CpuFeatures DetectCpuFeatures() {
  CpuFeatures cpu;
#if TESSERA_BLAS_X86
  __builtin_cpu_init();
  cpu.avx2_fma =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  cpu.avx512 = cpu.avx2_fma && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl");
#endif
  return cpu;
}

std::string BetterCoreType(absl::string_view corename, const CpuFeatures& cpu) {
  const bool fallback =
      std::find(std::begin(kFallbackCores), std::end(kFallbackCores),
                corename) != std::end(kFallbackCores);
  if (!fallback) return "";
  if (cpu.avx512) return "SkylakeX";
  if (cpu.avx2_fma) return "Haswell";
  return "";
}

double SgemmError() {
  // Odd sizes: every kernel's edge paths; the trainer's three forms.
  constexpr int m = 67, n = 53, k = 61;
  const std::vector<float> a = Values(m * k, 1), b = Values(k * n, 2);
  double worst = 0;
  for (int form = 0; form < 3; ++form) {
    // form 0: C = A B; 1: C = A^T' B with A stored k x m; 2: C = A B^T' with
    // B stored n x k. The same logical product each time.
    std::vector<float> at(k * m), bt(n * k);
    for (int i = 0; i < m; ++i)
      for (int p = 0; p < k; ++p) at[p * m + i] = a[i * k + p];
    for (int p = 0; p < k; ++p)
      for (int j = 0; j < n; ++j) bt[j * k + p] = b[p * n + j];
    std::vector<float> c(m * n, 0.0f);
    if (form == 0) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f,
                  a.data(), k, b.data(), n, 0.0f, c.data(), n);
    } else if (form == 1) {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, k, 1.0f,
                  at.data(), m, b.data(), n, 0.0f, c.data(), n);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f,
                  a.data(), k, bt.data(), k, 0.0f, c.data(), n);
    }
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < n; ++j) {
        double want = 0, scale = 0;
        for (int p = 0; p < k; ++p) {
          const double term = static_cast<double>(a[i * k + p]) * b[p * n + j];
          want += term;
          scale += std::fabs(term);
        }
        const double got = c[i * n + j];
        double error = std::fabs(got - want) / std::max(scale, 1e-30);
        if (std::isnan(error)) error = INFINITY;  // NaN counts as wrong
        worst = std::max(worst, error);
      }
    }
  }
  return worst;
}

std::string BlasCoreName() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "";
}

void ChooseBlasKernels(const char* program, char** argv) {
  if (const char* from = std::getenv(kReexecVariable)) {
    // Started again by the code below, with OPENBLAS_CORETYPE set.
    const std::string first = from;
    unsetenv(kReexecVariable);
    if (first == "!") return;  // came back to the library's own choice
    const std::string now = BlasCoreName();
    double error = SgemmError();
    if (std::getenv("TESSERA_TEST_BLAS_WRONG") != nullptr) error = 1;
    if (error <= 1e-4) {
      std::fprintf(stderr,
                   "%s: OpenBLAS chose its '%s' kernels for %s (%s); using "
                   "'%s' (checked against a reference product; set "
                   "OPENBLAS_CORETYPE to choose, TESSERA_BLAS_AUTO=0 to keep "
                   "the library's choice)\n",
                   program, first.c_str(), CpuDescription().c_str(),
                   Features(DetectCpuFeatures()).c_str(), now.c_str());
      return;
    }
    std::fprintf(stderr,
                 "%s: OpenBLAS's '%s' kernels computed a wrong product on %s "
                 "(relative error %g); keeping the library's own '%s'\n",
                 program, now.c_str(), CpuDescription().c_str(), error,
                 first.c_str());
    unsetenv("OPENBLAS_CORETYPE");
    setenv(kReexecVariable, "!", 1);
    execv("/proc/self/exe", argv);
    std::fprintf(stderr, "%s: cannot start again without OPENBLAS_CORETYPE\n",
                 program);
    std::exit(1);  // never train with kernels known to be wrong
  }
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;  // the user's
  if (const char* automatic = std::getenv("TESSERA_BLAS_AUTO");
      automatic != nullptr && std::string(automatic) == "0") {
    return;
  }
  const char* pretend = std::getenv("TESSERA_TEST_BLAS_CORENAME");
  const std::string name = pretend != nullptr ? pretend : BlasCoreName();
  const std::string better = BetterCoreType(name, DetectCpuFeatures());
  if (better.empty()) return;
  setenv("OPENBLAS_CORETYPE", better.c_str(), 1);
  setenv(kReexecVariable, name.c_str(), 1);
  std::fflush(nullptr);
  execv("/proc/self/exe", argv);
  std::fprintf(stderr,
               "%s: OpenBLAS chose its '%s' kernels for %s; cannot start again "
               "with OPENBLAS_CORETYPE=%s, keeping them\n",
               program, name.c_str(), CpuDescription().c_str(), better.c_str());
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kReexecVariable);
}

}  // namespace tessera
