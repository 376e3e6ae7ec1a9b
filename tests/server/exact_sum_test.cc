// ExactSum: the same bits whatever order the vectors come in, and those bits
// are the exact sum correctly rounded to float32 (checked against GNU MPFR's
// exact sum and rounding, an implementation independent of ours).
#include "server/exact_sum.h"

#include <gmp.h>
#include <mpfr.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/compression/two_bit.h"
#include "gtest/gtest.h"
#include "server/round_kernels.h"

namespace tessera {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// Sums `vectors` in the given order with ExactSum.
std::vector<float> Sum(const std::vector<std::vector<float>>& vectors,
                       const std::vector<size_t>& order) {
  ExactSum sum(vectors[0].size());
  for (size_t k : order) sum.AddFloats(vectors[k].data());
  const float* out = sum.Finish();
  return std::vector<float>(out, out + vectors[0].size());
}

std::vector<float> Sum(const std::vector<std::vector<float>>& vectors) {
  std::vector<size_t> order(vectors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  return Sum(vectors, order);
}

// The exact sum of finite values, rounded to nearest float32 by MPFR.
float Reference(const std::vector<float>& values) {
  mpfr_t acc;
  mpfr_init2(acc, 1200);  // exact for any sum of floats here
  mpfr_set_zero(acc, 1);
  for (float v : values) mpfr_add_d(acc, acc, v, MPFR_RNDN);  // exact
  const float r = mpfr_get_flt(acc, MPFR_RNDN);
  mpfr_clear(acc);
  return r;
}

float Column(const std::vector<std::vector<float>>& vectors, size_t i,
             std::vector<float>* column) {
  column->clear();
  for (const auto& v : vectors) column->push_back(v[i]);
  return Reference(*column);
}

TEST(ExactSumTest, CancellationsAndTiesAreExactAndCorrectlyRounded) {
  const float big = std::ldexp(1.0f, 100);
  const float max = std::numeric_limits<float>::max();
  const float tiny = std::numeric_limits<float>::denorm_min();
  struct Case {
    std::vector<float> values;
    float want;
  } cases[] = {
      {{big, 1.0f, -big}, 1.0f},  // float32 in order gives 0
      {{1e30f, 1.0f, -1e30f, 0.5f}, 1.5f},
      {{max, max, -max}, max},  // no overflow on the way
      {{max, max}, std::numeric_limits<float>::infinity()},
      {{tiny, tiny, tiny}, 3 * tiny},         // subnormals
      {{1.0f, std::ldexp(1.0f, -24)}, 1.0f},  // a tie: to even
      {{1.0f, std::ldexp(1.0f, -24), std::ldexp(1.0f, -100)},
       1.0f + std::ldexp(1.0f, -23)},  // just above the tie
      {{std::ldexp(1.0f, 60), 1.0f, -std::ldexp(1.0f, 60),
        std::ldexp(1.0f, -30)},
       1.0f},
      {{0.1f, 0.2f, -0.3f}, Reference({0.1f, 0.2f, -0.3f})},
      // The rest in the pair's second double decides a tie either way.
      {{1.0f, std::ldexp(1.0f, -24), -std::ldexp(1.0f, -100)}, 1.0f},
      {{-1.0f, -std::ldexp(1.0f, -24), -std::ldexp(1.0f, -100)},
       -1.0f - std::ldexp(1.0f, -23)},
      // The midpoint between the largest float and infinity, nudged.
      {{max, std::ldexp(1.0f, 103), std::ldexp(1.0f, -100)},
       std::numeric_limits<float>::infinity()},
      {{max, std::ldexp(1.0f, 103), -std::ldexp(1.0f, -100)}, max},
      // Cancelling highs leave a subnormal rest; an exact zero is +0.
      {{tiny, 1.0f, -1.0f}, tiny},
      {{std::ldexp(1.0f, 40), std::ldexp(1.0f, -40), -std::ldexp(1.0f, 40),
        -std::ldexp(1.0f, -40)},
       0.0f},
  };
  for (const Case& c : cases) {
    std::vector<std::vector<float>> vectors;
    for (float v : c.values) vectors.push_back({v});
    std::vector<size_t> order(vectors.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    do {
      EXPECT_EQ(Bits(Sum(vectors, order)[0]), Bits(c.want))
          << "first value " << c.values[0] << ", " << c.values.size()
          << " values";
    } while (std::next_permutation(order.begin(), order.end()));
    EXPECT_EQ(Bits(Reference(c.values)), Bits(c.want));
  }
}

TEST(ExactSumTest, AnyArrivalOrderGivesTheSameBitsAsTheExactSum) {
  std::mt19937_64 rng(20261123);
  std::uniform_int_distribution<int> exponent(-149, 127);
  std::uniform_int_distribution<int> coin(0, 9);
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  constexpr size_t kLength = 300;
  constexpr int kWorkers = 9;
  std::vector<std::vector<float>> pushes(kWorkers, std::vector<float>(kLength));
  for (size_t i = 0; i < kLength; ++i) {
    // Element i's pushes: magnitudes over the whole float32 range, one
    // narrow (gradient-like), some that cancel exactly, zeros.
    const bool narrow = i % 3 == 0;
    const int base = exponent(rng);
    for (int w = 0; w < kWorkers; ++w) {
      const int e =
          narrow ? std::clamp(base + coin(rng) - 5, -149, 127) : exponent(rng);
      float v = std::ldexp(unit(rng), e);
      if (coin(rng) < 5) v = -v;
      if (!std::isfinite(v)) v = std::numeric_limits<float>::max();
      if (coin(rng) == 0) v = 0.0f;
      pushes[w][i] = v;
    }
    if (i % 7 == 0) pushes[kWorkers - 1][i] = -pushes[0][i];  // cancels
  }
  const std::vector<float> first = Sum(pushes);
  size_t wide_seen = 0, pair_seen = 0;
  {
    ExactSum probe(kLength);
    for (const auto& p : pushes) probe.AddFloats(p.data());
    wide_seen = probe.wide_elements();
    pair_seen = probe.pair_elements();
    probe.Finish();
  }
  EXPECT_GT(wide_seen, kLength / 4) << "the exact accumulator was exercised";
  EXPECT_GT(pair_seen, 0u) << "the pair was exercised";
  std::vector<size_t> order(kWorkers);
  for (int w = 0; w < kWorkers; ++w) order[w] = w;
  for (int trial = 0; trial < 200; ++trial) {
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<float> again = Sum(pushes, order);
    for (size_t i = 0; i < kLength; ++i)
      ASSERT_EQ(Bits(again[i]), Bits(first[i])) << "element " << i;
  }
  std::vector<float> column;
  for (size_t i = 0; i < kLength; ++i) {
    const float want = Column(pushes, i, &column);
    ASSERT_EQ(Bits(first[i]), Bits(want)) << "element " << i;
  }
}

TEST(ExactSumTest, GradientLikeValuesStayInTheDouble) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> gauss(0.0f, 1e-3f);
  constexpr size_t kLength = 4096;
  std::vector<std::vector<float>> pushes(64, std::vector<float>(kLength));
  for (auto& p : pushes)
    for (float& v : p) v = gauss(rng);
  ExactSum sum(kLength);
  for (const auto& p : pushes) sum.AddFloats(p.data());
  EXPECT_EQ(sum.wide_elements(), 0u);
  const float* out = sum.Finish();
  std::vector<float> column;
  for (size_t i = 0; i < kLength; i += 97)
    EXPECT_EQ(Bits(out[i]), Bits(Column(pushes, i, &column))) << i;
}

// Pushes whose magnitudes spread over 2^-30..2^29 (an outlier-heavy
// gradient): every element needs more than a double, none more than the
// pair, so the sum stays at 16 bytes per element, and it is still the exact
// sum in any order. Release gives the memory back.
TEST(ExactSumTest, WideRangePushesStayInThePair) {
  std::mt19937_64 rng(20261126);
  std::uniform_int_distribution<int> exponent(-30, 29);
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  constexpr size_t kLength = 5000;
  constexpr int kWorkers = 16;
  std::vector<std::vector<float>> pushes(kWorkers, std::vector<float>(kLength));
  for (auto& p : pushes) {
    for (float& v : p) {
      v = std::ldexp(unit(rng), exponent(rng));
      if (rng() & 1) v = -v;
    }
  }
  ExactSum sum(kLength);
  for (const auto& p : pushes) sum.AddFloats(p.data());
  EXPECT_EQ(sum.wide_elements(), 0u);
  EXPECT_GT(sum.pair_elements(), kLength * 9 / 10);
  EXPECT_LE(sum.bytes(), kLength * 16 + 4096);
  const float* out = sum.Finish();
  std::vector<float> column;
  for (size_t i = 0; i < kLength; ++i)
    ASSERT_EQ(Bits(out[i]), Bits(Column(pushes, i, &column))) << i;
  const std::vector<float> first(out, out + kLength);
  sum.Release();
  EXPECT_EQ(sum.bytes(), 0u);
  std::vector<size_t> order(kWorkers);
  for (int w = 0; w < kWorkers; ++w) order[w] = w;
  for (int trial = 0; trial < 5; ++trial) {
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t k : order) sum.AddFloats(pushes[k].data());
    out = sum.Finish();
    for (size_t i = 0; i < kLength; ++i)
      ASSERT_EQ(Bits(out[i]), Bits(first[i])) << "trial " << trial << " " << i;
  }
}

TEST(ExactSumTest, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::vector<float>> pushes = {
      {1.0f, inf, inf, -0.0f, -0.0f, nan},
      {inf, 2.0f, -inf, -0.0f, 0.0f, 1.0f},
      {-5.0f, 3.0f, 1.0f, -0.0f, -0.0f, 2.0f},
  };
  std::vector<size_t> order = {0, 1, 2};
  do {
    const std::vector<float> s = Sum(pushes, order);
    EXPECT_EQ(s[0], inf);
    EXPECT_EQ(s[1], inf);
    EXPECT_TRUE(std::isnan(s[2]));
    EXPECT_EQ(Bits(s[3]), Bits(-0.0f)) << "every input -0";
    EXPECT_EQ(Bits(s[4]), Bits(0.0f));
    EXPECT_TRUE(std::isnan(s[5]));
  } while (std::next_permutation(order.begin(), order.end()));
}

TEST(ExactSumTest, TwoBitPushesDecodeStraightInAndBadOnesAddNothing) {
  constexpr size_t kLength = 37;  // not a multiple of 16
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> grad(-2.0f, 2.0f);
  ExactSum packed_sum(kLength), float_sum(kLength);
  for (int w = 0; w < 5; ++w) {
    std::vector<float> g(kLength), residual(kLength, 0.0f), decoded(kLength);
    for (float& v : g) v = grad(rng);
    std::vector<uint8_t> wire(compression::TwoBitCompressedBytes(kLength));
    ASSERT_TRUE(compression::TwoBitQuantize(g.data(), residual.data(), kLength,
                                            0.5f, wire.data())
                    .ok());
    ASSERT_TRUE(compression::TwoBitDequantize(wire.data(), wire.size(), kLength,
                                              0.5f, decoded.data())
                    .ok());
    ASSERT_TRUE(packed_sum.AddTwoBit(wire.data(), wire.size(), 0.5f).ok());
    float_sum.AddFloats(decoded.data());
    // A 0b01 code and a wrong size: refused, nothing added.
    std::vector<uint8_t> bad = wire;
    bad[0] = 0x40;
    EXPECT_EQ(packed_sum.AddTwoBit(bad.data(), bad.size(), 0.5f).code(),
              absl::StatusCode::kDataLoss);
    EXPECT_EQ(packed_sum.AddTwoBit(wire.data(), wire.size() - 4, 0.5f).code(),
              absl::StatusCode::kDataLoss);
  }
  EXPECT_EQ(packed_sum.wide_elements(), 0u);
  const float* a = packed_sum.Finish();
  const float* b = float_sum.Finish();
  for (size_t i = 0; i < kLength; ++i) EXPECT_EQ(Bits(a[i]), Bits(b[i])) << i;
}

// A random 2-bit payload of n values (codes +, -, 0; never 0b01) and what it
// decodes to with threshold t.
std::vector<uint8_t> RandomPayload(size_t n, float t, std::mt19937_64* rng,
                                   std::vector<float>* decoded) {
  std::vector<float> g(n), residual(n, 0.0f);
  std::uniform_real_distribution<float> grad(-3.0f * t, 3.0f * t);
  for (float& v : g) v = grad(*rng);
  std::vector<uint8_t> wire(compression::TwoBitCompressedBytes(n));
  EXPECT_TRUE(
      compression::TwoBitQuantize(g.data(), residual.data(), n, t, wire.data())
          .ok());
  decoded->resize(n);
  EXPECT_TRUE(compression::TwoBitDequantize(wire.data(), wire.size(), n, t,
                                            decoded->data())
                  .ok());
  return wire;
}

// 2-bit pushes of one threshold are counted (4 bytes an element) and each
// element rounded once at the end: the bits MPFR gives for the exact sum of
// the decoded values, also where c x t is not a float (t = 0.1f, 300 pushes)
// and where a float32 running sum would have rounded on the way.
TEST(ExactSumTest, TwoBitPushesOfOneThresholdAreCountedAndRoundedOnce) {
  constexpr size_t kLength = 1003;  // a partial last byte and word
  std::mt19937_64 rng(11);
  for (const float t : {0.1f, 0.5f, 3.0e-7f}) {
    ExactSum sum(kLength);
    std::vector<std::vector<float>> decoded(300);
    for (auto& d : decoded) {
      const std::vector<uint8_t> wire = RandomPayload(kLength, t, &rng, &d);
      ASSERT_TRUE(sum.AddTwoBit(wire.data(), wire.size(), t).ok());
      EXPECT_TRUE(sum.counting());
    }
    EXPECT_GT(sum.bytes(), 0u);
    const float* out = sum.Finish();
    std::vector<float> column;
    for (size_t i = 0; i < kLength; ++i)
      ASSERT_EQ(Bits(out[i]), Bits(Column(decoded, i, &column)))
          << t << " " << i;
    EXPECT_FALSE(sum.counting());
  }
}

// One sum over many rounds, as a slice's round uses it: each round's first
// push writes its codes over what the buffer held (the last round's floats),
// and every round still gives MPFR's bits; a round started by a float push or
// by a push to part of the values starts from zeros as before.
TEST(ExactSumTest, EachRoundsFirstTwoBitPushWritesOverTheLastRoundsSum) {
  constexpr size_t kLength = 1003;
  std::mt19937_64 rng(13);
  ExactSum sum(kLength);
  for (int round = 0; round < 6; ++round) {
    std::vector<std::vector<float>> decoded(3);
    for (auto& d : decoded) {
      const std::vector<uint8_t> wire = RandomPayload(kLength, 0.1f, &rng, &d);
      ASSERT_TRUE(sum.AddTwoBit(wire.data(), wire.size(), 0.1f).ok());
    }
    if (round % 2 == 1) {
      // A float push joins: the counts become doubles, exactly.
      std::vector<float> f(kLength);
      for (size_t i = 0; i < kLength; ++i) f[i] = static_cast<float>(i) * 0.25f;
      sum.AddFloats(f.data());
      decoded.push_back(f);
    }
    const float* out = sum.Finish();
    std::vector<float> column;
    for (size_t i = 0; i < kLength; ++i)
      ASSERT_EQ(Bits(out[i]), Bits(Column(decoded, i, &column)))
          << "round " << round << " value " << i;
    if (round == 3) sum.Release();  // as a slice's round does after its update
  }
}

// The counts as int8 (a replicated round's update): widened and rounded by
// CountsToFloats they are Finish's floats, bit for bit; past 127 pushes that
// agree on a value's sign they no longer fit and PackCounts says so.
TEST(ExactSumTest, PackedCountsRoundToFinishsFloats) {
  constexpr size_t kLength = 1003;
  std::mt19937_64 rng(12);
  for (const int pushes : {3, 127}) {
    ExactSum sum(kLength);
    std::vector<std::vector<float>> decoded(pushes);
    for (auto& d : decoded) {
      const std::vector<uint8_t> wire = RandomPayload(kLength, 0.1f, &rng, &d);
      ASSERT_TRUE(sum.AddTwoBit(wire.data(), wire.size(), 0.1f).ok());
    }
    std::vector<int8_t> packed(kLength);
    float t = 0;
    ASSERT_TRUE(sum.PackCounts(packed.data(), &t)) << pushes;
    EXPECT_EQ(t, 0.1f);
    std::vector<int32_t> wide(packed.begin(), packed.end());
    std::vector<float> again(kLength);
    round_kernels::CountsToFloats(wide.data(), kLength, t, again.data());
    const float* out = sum.Finish();
    for (size_t i = 0; i < kLength; ++i)
      ASSERT_EQ(Bits(out[i]), Bits(again[i])) << pushes << " " << i;
    EXPECT_FALSE(sum.PackCounts(packed.data(), &t)) << "not counting any more";
  }
  // 128 pushes of +t on every value: a count of 128.
  ExactSum sum(5);
  std::vector<float> ones(5, 1.0f), residual(5, 0.0f);
  std::vector<uint8_t> wire(compression::TwoBitCompressedBytes(5));
  for (int i = 0; i < 128; ++i) {
    std::fill(residual.begin(), residual.end(), 0.0f);
    ASSERT_TRUE(compression::TwoBitQuantize(ones.data(), residual.data(), 5,
                                            0.5f, wire.data())
                    .ok());
    ASSERT_TRUE(sum.AddTwoBit(wire.data(), wire.size(), 0.5f).ok());
  }
  std::vector<int8_t> packed(5);
  float t = 0;
  EXPECT_FALSE(sum.PackCounts(packed.data(), &t));
}

// A float push, or a 2-bit push of another threshold, turns the counts into
// doubles exactly; the sum stays the exact one in any order.
TEST(ExactSumTest, MixedPushesLeaveTheCountsExactly) {
  constexpr size_t kLength = 77;
  std::mt19937_64 rng(5);
  std::vector<std::vector<float>> decoded(4);
  const std::vector<uint8_t> a =
      RandomPayload(kLength, 0.25f, &rng, &decoded[0]);
  const std::vector<uint8_t> b =
      RandomPayload(kLength, 0.25f, &rng, &decoded[1]);
  const std::vector<uint8_t> c =
      RandomPayload(kLength, 0.3f, &rng, &decoded[2]);
  decoded[3].resize(kLength);
  std::uniform_real_distribution<float> u(-1e3f, 1e3f);
  for (float& v : decoded[3]) v = u(rng);
  std::vector<size_t> order = {0, 1, 2, 3};
  std::vector<uint32_t> first;
  do {
    ExactSum sum(kLength);
    for (size_t k : order) {
      if (k == 3) {
        sum.AddFloats(decoded[3].data());
      } else {
        const std::vector<uint8_t>& w = k == 0 ? a : (k == 1 ? b : c);
        ASSERT_TRUE(
            sum.AddTwoBit(w.data(), w.size(), k == 2 ? 0.3f : 0.25f).ok());
      }
    }
    const float* out = sum.Finish();
    std::vector<float> column;
    for (size_t i = 0; i < kLength; ++i)
      ASSERT_EQ(Bits(out[i]), Bits(Column(decoded, i, &column))) << i;
  } while (std::next_permutation(order.begin(), order.end()));
}

// Rows: values [first, first + count) of a payload, counted into elements
// [begin, begin + count), also where neither starts on a payload byte.
TEST(ExactSumTest, TwoBitValuesAddAtAnyPlace) {
  std::mt19937_64 rng(8);
  std::vector<float> d;
  const std::vector<uint8_t> wire = RandomPayload(40, 0.5f, &rng, &d);
  ExactSum sum(0);
  sum.Grow(30);
  sum.AddTwoBitAt(3, wire.data(), 5, 11, 0.5f);    // unaligned both ways
  sum.AddTwoBitAt(16, wire.data(), 20, 14, 0.5f);  // whole bytes, a tail
  sum.AddTwoBitAt(3, wire.data(), 5, 2, 0.5f);     // again, the first two
  const float* out = sum.Finish();
  std::vector<float> want(30, 0.0f);
  for (int j = 0; j < 11; ++j) want[3 + j] += d[5 + j];
  for (int j = 0; j < 14; ++j) want[16 + j] += d[20 + j];
  for (int j = 0; j < 2; ++j) want[3 + j] += d[5 + j];
  for (size_t i = 0; i < 30; ++i) EXPECT_EQ(out[i], want[i]) << i;
  // Nothing added: zeros.
  const float* none = sum.Finish();
  for (size_t i = 0; i < 30; ++i) EXPECT_EQ(Bits(none[i]), 0u) << i;
}

TEST(ExactSumTest, ASumStartsAfterFinish) {
  ExactSum sum(3);
  const float a[] = {1, 2, 3}, b[] = {10, 20, 30};
  sum.AddFloats(a);
  sum.AddFloats(b);
  const float* first = sum.Finish();
  EXPECT_EQ(std::vector<float>(first, first + 3),
            (std::vector<float>{11, 22, 33}));
  sum.AddFloats(b);
  const float* second = sum.Finish();
  EXPECT_EQ(std::vector<float>(second, second + 3),
            (std::vector<float>{10, 20, 30}));
}

}  // namespace
}  // namespace tessera
