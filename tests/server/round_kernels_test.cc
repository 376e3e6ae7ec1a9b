// The server's round loops (server/round_kernels.h): the AVX2 loops give the
// same bits as the baseline loops, and both give what the per-value
// definitions say, on awkward lengths and values (NaN, infinities, -0,
// additions that round, subnormals, ties of the threshold).
#include "server/round_kernels.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/compression/simd.h"
#include "common/compression/two_bit.h"
#include "common/compression/two_bit_testing.h"
#include "gtest/gtest.h"

namespace tessera::round_kernels {
namespace {

uint64_t Bits(double d) {
  uint64_t b;
  std::memcpy(&b, &d, 8);
  return b;
}
uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Values of every kind, so that additions round, overflow, cancel.
std::vector<float> AwkwardFloats(size_t n, std::mt19937* rng) {
  std::vector<float> v(n);
  std::uniform_int_distribution<int> kind(0, 9);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-140, 120);
  for (float& x : v) {
    switch (kind(*rng)) {
      case 0:
        x = std::numeric_limits<float>::quiet_NaN();
        break;
      case 1:
        x = std::numeric_limits<float>::infinity() * (u(*rng) < 0 ? -1 : 1);
        break;
      case 2:
        x = -0.0f;
        break;
      case 3:
        x = std::ldexp(u(*rng), e(*rng));
        break;
      case 4:
        x = 1e-44f;
        break;
      default:
        x = u(*rng);
        break;
    }
  }
  return v;
}

// Runs `f` once with the AVX2 loops (when the CPU has them) and once with the
// baseline forced.
template <typename F>
void OnEveryTarget(F&& f) {
  const bool avx2 = compression::UseAvx2Loops();
  f("default");
  compression::ForceBaselineSimdForTesting(true);
  EXPECT_FALSE(compression::UseAvx2Loops());
  f("baseline");
  compression::ForceBaselineSimdForTesting(false);
  EXPECT_EQ(compression::UseAvx2Loops(), avx2);
  if (!avx2) GTEST_LOG_(INFO) << "no AVX2 on this CPU: only the baseline ran";
}

TEST(RoundKernelsTest, AddExactlyMatchesTwoSumPerValueOnEveryTarget) {
  std::mt19937 rng(1);
  for (size_t n : {0, 1, 3, 4, 5, 63, 64}) {
    std::vector<double> start(n);
    std::uniform_real_distribution<double> big(-1e20, 1e20);
    const std::vector<float> seeds = AwkwardFloats(n, &rng);
    for (size_t i = 0; i < n; ++i)
      start[i] =
          i % 3 == 0 ? big(rng) : (i % 3 == 1 ? 0.0 : seeds[(i + 1) % n]);
    for (double& x : start)
      if (std::isnan(x)) x = 1.0;
    const std::vector<float> v = AwkwardFloats(n, &rng);
    // The definition, value by value.
    std::vector<double> want = start;
    std::vector<uint8_t> want_rounded(n);
    for (size_t i = 0; i < n; ++i) {
      const double x = start[i], y = v[i], s = x + y, bb = s - x;
      const double err = (x - (s - bb)) + (y - bb);
      const bool exact = err == 0.0;  // false for NaN
      if (exact) want[i] = s;
      want_rounded[i] = !exact;
    }
    OnEveryTarget([&](const char* target) {
      std::vector<double> a = start;
      std::vector<uint8_t> rounded(n, 7);
      const bool any = AddExactly(a.data(), v.data(), rounded.data(), n);
      bool want_any = false;
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(Bits(a[i]), Bits(want[i]))
            << target << " n=" << n << " i=" << i;
        ASSERT_EQ(rounded[i], want_rounded[i]) << target << " i=" << i;
        want_any |= want_rounded[i] != 0;
      }
      EXPECT_EQ(any, want_any) << target;
    });
  }
}

TEST(RoundKernelsTest, AddPairExactlyMatchesTwoTwoSumsPerValueOnEveryTarget) {
  std::mt19937 rng(2);
  for (size_t n : {0, 1, 3, 4, 5, 63, 64, 257}) {
    std::uniform_real_distribution<double> big(-1e20, 1e20);
    std::uniform_int_distribution<int> tiny_exp(-140, -60);
    const std::vector<float> seeds = AwkwardFloats(n, &rng);
    std::vector<double> hi0(n), lo0(n);
    for (size_t i = 0; i < n; ++i) {
      // Highs: big, zero, awkward; rests: zero, tiny, or one that already
      // fills its double (so that another rest does not fit).
      hi0[i] = i % 3 == 0 ? big(rng) : (i % 3 == 1 ? 0.0 : seeds[(i + 1) % n]);
      if (!std::isfinite(hi0[i])) hi0[i] = 1.0;
      lo0[i] = i % 4 == 0   ? 0.0
               : i % 4 == 1 ? std::ldexp(1.0 + i * 0x1p-40, tiny_exp(rng))
               : i % 4 == 2 ? std::ldexp(1.0 + 0x1p-52, -20)
                            : -std::ldexp(1.0, tiny_exp(rng));
    }
    const std::vector<float> v = AwkwardFloats(n, &rng);
    std::vector<double> want_hi = hi0, want_lo = lo0;
    std::vector<uint8_t> want_rounded(n);
    size_t taken = 0, refused = 0;
    for (size_t i = 0; i < n; ++i) {
      const double x = hi0[i], y = v[i], s = x + y, bb = s - x;
      const double e = (x - (s - bb)) + (y - bb);
      const double l = lo0[i], t = l + e, tb = t - l;
      const double e2 = (l - (t - tb)) + (e - tb);
      const bool exact = e2 == 0.0;  // false for NaN
      if (exact) {
        want_hi[i] = s;
        want_lo[i] = t;
      }
      want_rounded[i] = !exact;
      (exact ? taken : refused) += 1;
    }
    if (n >= 64) {
      EXPECT_GT(taken, n / 4) << n;
      EXPECT_GT(refused, 0u) << n;
    }
    OnEveryTarget([&](const char* target) {
      std::vector<double> hi = hi0, lo = lo0;
      std::vector<uint8_t> rounded(n, 7);
      const bool any =
          AddPairExactly(hi.data(), lo.data(), v.data(), rounded.data(), n);
      bool want_any = false;
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(Bits(hi[i]), Bits(want_hi[i]))
            << target << " n=" << n << " i=" << i;
        ASSERT_EQ(Bits(lo[i]), Bits(want_lo[i]))
            << target << " n=" << n << " i=" << i;
        ASSERT_EQ(rounded[i], want_rounded[i]) << target << " i=" << i;
        want_any |= want_rounded[i] != 0;
      }
      EXPECT_EQ(any, want_any) << target;
    });
  }
}

TEST(RoundKernelsTest, CodeWordsAndCountsAgreeOnEveryTarget) {
  std::mt19937 rng(2);
  const size_t words = 37;
  std::vector<uint8_t> payload(4 * words);
  for (uint8_t& b : payload) {
    // Codes 0b00, 0b10, 0b11 only (0b01 never reaches here).
    uint8_t byte = 0;
    for (int k = 0; k < 4; ++k) {
      const uint32_t pick = rng() % 3;
      byte |= static_cast<uint8_t>((pick == 0   ? 0b00
                                    : pick == 1 ? 0b10
                                                : 0b11)
                                   << (2 * k));
    }
    b = byte;
  }
  std::vector<int32_t> start(16 * words);
  for (int32_t& c : start) c = static_cast<int32_t>(rng() % 2001) - 1000;
  // The definition: decode with the codec and add.
  std::vector<float> decoded(16 * words);
  ASSERT_TRUE(compression::TwoBitDequantize(payload.data(), payload.size(),
                                            decoded.size(), 1.0f,
                                            decoded.data())
                  .ok());
  OnEveryTarget([&](const char* target) {
    std::vector<int32_t> c = start;
    AddCodeWords(c.data(), payload.data(), words);
    for (size_t i = 0; i < c.size(); ++i)
      ASSERT_EQ(c[i], start[i] + static_cast<int32_t>(decoded[i]))
          << target << i;
    // Set: the codes themselves, whatever the counts held.
    std::vector<int32_t> set = start;
    SetCodeWords(set.data(), payload.data(), words);
    for (size_t i = 0; i < set.size(); ++i)
      ASSERT_EQ(set[i], static_cast<int32_t>(decoded[i])) << target << i;
    // Counts to floats: rounded once, in place or not; t = 0.1f makes
    // c x t inexact in float32 for most c.
    for (const float t : {0.1f, 3.0e38f, 1e-45f}) {
      std::vector<float> out(c.size());
      CountsToFloats(c.data(), c.size() - 3, t, out.data());
      std::vector<int32_t> in_place = c;
      CountsToFloats(in_place.data(), in_place.size() - 3, t,
                     reinterpret_cast<float*>(in_place.data()));
      for (size_t i = 0; i + 3 < c.size(); ++i) {
        const float want = static_cast<float>(static_cast<double>(c[i]) * t);
        ASSERT_EQ(Bits(out[i]), Bits(want))
            << target << " t=" << t << " i=" << i;
        float got;
        std::memcpy(&got, &in_place[i], 4);
        ASSERT_EQ(Bits(got), Bits(want)) << target << " in place, i=" << i;
      }
    }
  });
}

TEST(RoundKernelsTest, ChangeCodingMatchesTheWorkersDecodeOnEveryTarget) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (size_t n : {1, 15, 16, 17, 1000, 1024}) {
    std::vector<float> w(n), s0(n);
    for (size_t i = 0; i < n; ++i) {
      w[i] = u(rng);
      s0[i] = i % 5 == 0 ? w[i] : u(rng);   // some unchanged
      if (i % 7 == 3) s0[i] = w[i] - 0.5f;  // exactly at the threshold below
      if (i % 11 == 4) s0[i] = -0.0f;
    }
    double mean = 0;
    std::vector<uint8_t> first_out;
    std::vector<float> first_s;
    OnEveryTarget([&](const char* target) {
      const double m = MeanAbsDifference(w.data(), s0.data(), n);
      if (first_out.empty()) {
        mean = m;
      } else {
        ASSERT_EQ(Bits(m), Bits(mean)) << target << " n=" << n;
      }
      // The definition of the mean: eight partial sums, fixed order.
      double part[8] = {0};
      for (size_t i = 0; i < n; ++i)
        part[n - n % 8 > i ? i % 8 : 0] +=
            std::fabs(static_cast<double>(w[i] - s0[i]));
      const double want = (((part[0] + part[1]) + (part[2] + part[3])) +
                           ((part[4] + part[5]) + (part[6] + part[7]))) /
                          n;
      ASSERT_EQ(Bits(m), Bits(want)) << target;
      const float t = 0.5f;
      std::vector<float> s = s0;
      std::vector<uint8_t> out(compression::TwoBitCompressedBytes(n), 0xff);
      CodeChange(w.data(), s.data(), n, t, out.data());
      // The worker's side: its copy (s0) plus the decoded codes, with the
      // codec's own decode; the shadow must be that, bit for bit.
      std::vector<float> worker = s0;
      ASSERT_TRUE(compression::TwoBitDequantizeAdd(out.data(), out.size(), n, t,
                                                   worker.data())
                      .ok())
          << target;  // also: padding slots are 0
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(Bits(s[i]), Bits(worker[i]))
            << target << " n=" << n << " i=" << i;
        const float r = w[i] - s0[i];
        const float want_s = s0[i] + (r >= t ? t : (r <= -t ? -t : 0.0f));
        ASSERT_EQ(Bits(s[i]), Bits(want_s)) << target << " i=" << i;
      }
      if (first_out.empty()) {
        first_out = out;
        first_s = s;
      } else {
        EXPECT_EQ(out, first_out) << target;
      }
    });
  }
}

}  // namespace
}  // namespace tessera::round_kernels
