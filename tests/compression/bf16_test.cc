// bfloat16 on the wire (common/compression/bf16.h): rounding to nearest, ties
// to even, against a reference computed another way (the nearest of the two
// neighbouring bfloat16 values, by exact comparison in double), over every
// kind of float32: ties, carries into the exponent, infinities, NaN,
// subnormals.
#include "common/compression/bf16.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tessera::compression {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The nearest bfloat16 by value: truncation and the next one up in
// magnitude, compared exactly in double; a tie goes to the even pattern.
uint16_t Reference(float x) {
  const uint32_t b = Bits(x);
  const uint16_t down = static_cast<uint16_t>(b >> 16);
  const uint16_t up = static_cast<uint16_t>(down + 1);
  const double dx = x;
  const double dd = FromBits(static_cast<uint32_t>(down) << 16);
  // Past the largest finite value, 'up' is infinity: the overflow threshold
  // is halfway to 2^128.
  const double du =
      (up & 0x7fff) == 0x7f80
          ? std::copysign(std::ldexp(1.0, 128), dx)
          : static_cast<double>(FromBits(static_cast<uint32_t>(up) << 16));
  const double to_down = std::fabs(dx - dd), to_up = std::fabs(du - dx);
  if (to_down < to_up) return down;
  if (to_up < to_down) return up;
  return (down & 1) == 0 ? down : up;
}

TEST(Bf16Test, RoundsToNearestTiesToEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 0.00390625f), 0x3f80);  // 1 + 2^-8: tie, even
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0.00390625f), 0x3f82);  // tie, up to even
  EXPECT_EQ(FloatToBf16(1.0f + 0.005859375f), 0x3f81);     // above the tie
  EXPECT_EQ(FloatToBf16(-3.3f), 0xc053);
  EXPECT_EQ(Bf16ToFloat(0xc053), -3.296875f);
  // A carry out of the fraction moves the exponent: 2 - 2^-23 -> 2.
  EXPECT_EQ(FloatToBf16(std::nextafter(2.0f, 0.0f)), 0x4000);
  // The largest float rounds past bfloat16's largest finite: infinity.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  // Subnormals round like any other value.
  EXPECT_EQ(FloatToBf16(FromBits(0x00008000u)), 0x0000);  // tie to even 0
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000u)), 0x0002);  // tie up to even
  EXPECT_EQ(FloatToBf16(FromBits(0x00008001u)), 0x0001);
  // NaN stays NaN, quiet, whatever its payload (also one that rounding
  // would carry into infinity).
  for (uint32_t nan : {0x7f800001u, 0x7fc00000u, 0xffffffffu, 0x7f80ffffu}) {
    const float back = Bf16ToFloat(FloatToBf16(FromBits(nan)));
    EXPECT_TRUE(std::isnan(back)) << std::hex << nan;
    EXPECT_EQ(Bits(back) >> 31, nan >> 31);
  }
}

TEST(Bf16Test, EveryKindOfFloatAgreesWithTheReferenceAndTheLoops) {
  std::mt19937 rng(27);
  std::vector<float> in;
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = rng();
    if (i % 4 == 1) b = (b & 0xffff0000u) | 0x8000u;  // exact ties
    if (i % 4 == 2) b &= 0x807fffffu;                 // subnormals
    const float f = FromBits(b);
    if (!std::isnan(f)) in.push_back(f);
  }
  std::vector<uint16_t> out(in.size());
  FloatsToBf16(in.data(), in.size(), out.data());
  std::vector<float> back(in.size());
  Bf16ToFloats(out.data(), out.size(), back.data());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i], Reference(in[i])) << std::hex << Bits(in[i]);
    ASSERT_EQ(out[i], FloatToBf16(in[i]));
    ASSERT_EQ(Bits(back[i]), static_cast<uint32_t>(out[i]) << 16);
  }
}

}  // namespace
}  // namespace tessera::compression
