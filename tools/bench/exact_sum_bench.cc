// What the server's exact, order-independent round sum costs per push, beside
// what a plain float32 sum costs and a memcpy of the same bytes, all measured
// in this run on this machine:
//
//   exact_sum_bench [--mb 64] [--pushes 8] [--reps 5]
//
// Rows (GB/s of float32 push values added; median of --reps):
//   memcpy            copying the push (a baseline of memory bandwidth)
//   float32 add       sum[i] += push[i] (what an arrival-order float sum costs)
//   rank-order sum    keep every push, then add them in rank order at the end
//                     (the server before ExactSum: n pushes held in memory)
//   ExactSum floats   ExactSum::AddFloats (a double per value, TwoSum-checked)
//   ExactSum 2-bit    ExactSum::AddTwoBit (decoded straight in; GB/s of the
//                     float32 values the payload stands for)
//   ExactSum wide     ExactSum::AddFloats of pushes whose magnitudes spread
//                     over 2^-30..2^29 (sums that do not fit a double), and
//                     the bytes the sum held, per value
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/compression/two_bit.h"
#include "server/exact_sum.h"

namespace {

double Seconds(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

template <typename F>
double MedianGbps(int reps, double bytes, F&& f) {
  std::vector<double> gbps;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    gbps.push_back(bytes / Seconds(start) / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  return gbps[gbps.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  double mb = 64;
  int pushes = 8, reps = 5;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string(name) + "=";
      if (a.rfind(prefix, 0) == 0) return argv[i] + prefix.size();
      return nullptr;
    };
    if (const char* v = value("--mb")) {
      mb = std::atof(v);
    } else if (const char* v = value("--pushes")) {
      pushes = std::atoi(v);
    } else if (const char* v = value("--reps")) {
      reps = std::atoi(v);
    } else {
      std::fprintf(stderr,
                   "exact_sum_bench: unknown flag '%s': expected --mb=N, "
                   "--pushes=N or --reps=N\n",
                   argv[i]);
      return 2;
    }
  }
  if (!(mb > 0) || pushes < 2 || reps < 1) {
    std::fprintf(stderr,
                 "exact_sum_bench: expected --mb > 0, --pushes >= 2, "
                 "--reps >= 1\n");
    return 2;
  }
  const size_t n = static_cast<size_t>(mb * 1e6 / 4);
  std::mt19937 rng(1);
  std::normal_distribution<float> gauss(0.0f, 1e-2f);
  std::vector<std::vector<float>> push(pushes, std::vector<float>(n));
  for (auto& p : push)
    for (float& v : p) v = gauss(rng);
  std::vector<std::vector<uint8_t>> packed(pushes);
  for (int k = 0; k < pushes; ++k) {
    std::vector<float> residual(n, 0.0f);
    packed[k].resize(tessera::compression::TwoBitCompressedBytes(n));
    (void)tessera::compression::TwoBitQuantize(push[k].data(), residual.data(),
                                               n, 0.005f, packed[k].data());
  }
  std::vector<std::vector<float>> wide(pushes, std::vector<float>(n));
  {
    std::uniform_int_distribution<int> exponent(-30, 29);
    std::uniform_real_distribution<float> unit(1.0f, 2.0f);
    for (auto& p : wide) {
      for (float& v : p) {
        v = std::ldexp(unit(rng), exponent(rng));
        if (rng() & 1) v = -v;
      }
    }
  }
  const double bytes = static_cast<double>(n) * 4 * pushes;
  std::vector<float> sum(n), copy(n);

  const double memcpy_gbps = MedianGbps(reps, bytes, [&] {
    for (int k = 0; k < pushes; ++k)
      std::memcpy(copy.data(), push[k].data(), n * 4);
  });
  const double float_gbps = MedianGbps(reps, bytes, [&] {
    std::memcpy(sum.data(), push[0].data(), n * 4);
    for (int k = 1; k < pushes; ++k) {
      const float* p = push[k].data();
      for (size_t i = 0; i < n; ++i) sum[i] += p[i];
    }
  });
  std::vector<std::vector<float>> held(pushes, std::vector<float>(n));
  const double rank_gbps = MedianGbps(reps, bytes, [&] {
    for (int k = 0; k < pushes; ++k)  // each push kept on arrival
      std::memcpy(held[k].data(), push[k].data(), n * 4);
    std::memcpy(sum.data(), held[0].data(), n * 4);
    for (int k = 1; k < pushes; ++k) {
      const float* p = held[k].data();
      for (size_t i = 0; i < n; ++i) sum[i] += p[i];
    }
  });
  held.clear();
  tessera::ExactSum exact(n);
  const double exact_gbps = MedianGbps(reps, bytes, [&] {
    for (int k = 0; k < pushes; ++k) exact.AddFloats(push[k].data());
    exact.Finish();
  });
  const double two_bit_gbps = MedianGbps(reps, bytes, [&] {
    for (int k = 0; k < pushes; ++k)
      (void)exact.AddTwoBit(packed[k].data(), packed[k].size(), 0.005f);
    exact.Finish();
  });
  uint64_t wide_bytes = 0;
  const double wide_gbps = MedianGbps(reps, bytes, [&] {
    for (int k = 0; k < pushes; ++k) exact.AddFloats(wide[k].data());
    wide_bytes = std::max<uint64_t>(wide_bytes, exact.bytes());
    exact.Finish();
  });
  std::printf("exact_sum_bench: %d pushes of %.1f MB (float32), median of %d\n",
              pushes, n * 4 / 1e6, reps);
  std::printf("%-18s %8s %10s\n", "", "GB/s", "x memcpy");
  const struct {
    const char* name;
    double gbps;
  } rows[] = {{"memcpy", memcpy_gbps},          {"float32 add", float_gbps},
              {"rank-order sum", rank_gbps},    {"ExactSum floats", exact_gbps},
              {"ExactSum 2-bit", two_bit_gbps}, {"ExactSum wide", wide_gbps}};
  for (const auto& r : rows)
    std::printf("%-18s %8.2f %10.2f\n", r.name, r.gbps, r.gbps / memcpy_gbps);
  std::printf(
      "ExactSum wide held %.1f bytes per value (%.0f MB for %.1f MB "
      "of float32)\n",
      static_cast<double>(wide_bytes) / n, wide_bytes / 1e6, n * 4 / 1e6);
  return 0;
}
