// Tests of the CPU 2-bit codec: MXNet's test vectors, a plain scalar reference
// (two_bit_reference.h) and the validation of malformed payloads.
#include "common/compression/two_bit.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/compression/two_bit_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/compression/two_bit_reference.h"

namespace tessera::compression {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr float kT = 0.5f;

// Runs the codec on its baseline (non-AVX2) loop while alive.
class ScopedBaselineSimd {
 public:
  explicit ScopedBaselineSimd(bool baseline) {
    ForceBaselineSimdForTesting(baseline);
  }
  ~ScopedBaselineSimd() { ForceBaselineSimdForTesting(false); }
};

// The SIMD loops the codec can take here: the run-time pick, and the baseline.
class TwoBitSimdTest : public ::testing::TestWithParam<bool> {
 protected:
  ScopedBaselineSimd simd_{GetParam()};
};

INSTANTIATE_TEST_SUITE_P(Paths, TwoBitSimdTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Baseline" : "Dispatched";
                         });

TEST(TwoBitSimdPathTest, BaselineCanBeForced) {
  ScopedBaselineSimd baseline(true);
  EXPECT_FALSE(TwoBitUsesAvx2ForTesting());
}

TEST(TwoBitCompressedBytesTest, FourBytesPerSixteenElements) {
  EXPECT_EQ(TwoBitCompressedBytes(0), 0u);
  EXPECT_EQ(TwoBitCompressedBytes(1), 4u);
  EXPECT_EQ(TwoBitCompressedBytes(16), 4u);
  EXPECT_EQ(TwoBitCompressedBytes(17), 8u);
  EXPECT_EQ(TwoBitCompressedBytes(1000), 4u * 63);
  // No overflow at the top of the range.
  const size_t max = std::numeric_limits<size_t>::max();
  EXPECT_EQ(TwoBitCompressedBytes(max), 4 * (max / 16 + 1));
}

TEST_P(TwoBitSimdTest, ReferenceVectorEightElements) {
  const std::vector<float> grad = {0.6f,  -0.7f, 0.2f, 0.5f,
                                   -0.5f, 0.49f, 1.0f, -2.0f};
  std::vector<float> residual(grad.size(), 0.0f);
  std::vector<uint8_t> out(TwoBitCompressedBytes(grad.size()), 0xAA);
  ASSERT_TRUE(
      TwoBitQuantize(grad.data(), residual.data(), grad.size(), kT, out.data())
          .ok());
  EXPECT_THAT(out, ElementsAre(0xE3, 0x8E, 0x00, 0x00));
  const std::vector<float> want = {0.1f, -0.2f, 0.2f, 0.0f,
                                   0.0f, 0.49f, 0.5f, -1.5f};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(residual[i], want[i], 1e-6) << "element " << i;
  }

  std::vector<float> decoded(grad.size(), 99.0f);
  ASSERT_TRUE(
      TwoBitDequantize(out.data(), out.size(), grad.size(), kT, decoded.data())
          .ok());
  EXPECT_THAT(decoded,
              ElementsAre(0.5f, -0.5f, 0.0f, 0.5f, -0.5f, 0.0f, 0.5f, -0.5f));
}

TEST_P(TwoBitSimdTest, ReferenceVectorSeventeenOnes) {
  const std::vector<float> grad(17, 1.0f);
  std::vector<float> residual(17, 0.0f);
  std::vector<uint8_t> out(TwoBitCompressedBytes(17), 0x55);
  ASSERT_TRUE(
      TwoBitQuantize(grad.data(), residual.data(), 17, kT, out.data()).ok());
  EXPECT_THAT(out, ElementsAre(0xFF, 0xFF, 0xFF, 0xFF, 0xC0, 0x00, 0x00, 0x00));
  for (float r : residual) EXPECT_EQ(r, 0.5f);
}

TEST_P(TwoBitSimdTest, MatchesScalarReferenceOnOddLengths) {
  std::mt19937 rng(20240611);
  std::normal_distribution<float> normal(0.0f, 0.6f);
  for (size_t len : {0u, 1u, 2u, 3u, 4u, 5u, 15u, 16u, 17u, 31u, 32u, 33u, 63u,
                     65u, 1000u, 4097u, 65537u}) {
    for (float t : {0.5f, 0.1f, 1.0f, 1e-3f}) {
      std::vector<float> grad(len), residual(len), ref_residual(len);
      for (size_t i = 0; i < len; ++i) {
        residual[i] = ref_residual[i] = normal(rng);
      }
      // Three pushes: the residual carries over.
      for (int push = 0; push < 3; ++push) {
        for (float& g : grad) g = normal(rng);
        std::vector<uint8_t> out(TwoBitCompressedBytes(len), 0xCC);
        ASSERT_TRUE(
            TwoBitQuantize(grad.data(), residual.data(), len, t, out.data())
                .ok());
        const std::vector<uint8_t> want =
            testing_reference::Quantize(grad, ref_residual, t);
        ASSERT_EQ(out, want) << "len " << len << " t " << t << " push " << push;
        for (size_t i = 0; i < len; ++i) {
          // Bit-exact, not merely close.
          ASSERT_EQ(std::signbit(residual[i]), std::signbit(ref_residual[i]));
          ASSERT_EQ(residual[i], ref_residual[i])
              << "len " << len << " element " << i;
        }
        std::vector<float> decoded(len, 7.0f);
        ASSERT_TRUE(
            TwoBitDequantize(out.data(), out.size(), len, t, decoded.data())
                .ok());
        ASSERT_EQ(decoded, testing_reference::Dequantize(out, len, t));
      }
    }
  }
}

TEST_P(TwoBitSimdTest, ResidualPlusDecodedConservesTheGradient) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  const size_t len = 4097;
  std::vector<float> grad(len), residual(len);
  for (size_t i = 0; i < len; ++i) {
    grad[i] = uniform(rng);
    residual[i] = uniform(rng);
  }
  const std::vector<float> before = residual;
  std::vector<uint8_t> out(TwoBitCompressedBytes(len));
  ASSERT_TRUE(
      TwoBitQuantize(grad.data(), residual.data(), len, kT, out.data()).ok());
  std::vector<float> decoded(len);
  ASSERT_TRUE(
      TwoBitDequantize(out.data(), out.size(), len, kT, decoded.data()).ok());
  for (size_t i = 0; i < len; ++i) {
    const float lhs = residual[i] + decoded[i];
    const float rhs = before[i] + grad[i];
    EXPECT_NEAR(lhs, rhs, 1e-6f * std::max(1.0f, std::fabs(rhs)))
        << "element " << i;
  }
}

TEST(TwoBitQuantizeTest, ResidualStaysAboveThresholdWhenGradientIsLarge) {
  // Only one t leaves per push: 2.0 pushed three times leaves 1.5, 3.0, 4.5.
  std::vector<float> grad(1, 2.0f), residual(1, 0.0f);
  std::vector<uint8_t> out(4);
  for (float want : {1.5f, 3.0f, 4.5f}) {
    ASSERT_TRUE(
        TwoBitQuantize(grad.data(), residual.data(), 1, kT, out.data()).ok());
    EXPECT_THAT(out, ElementsAre(0xC0, 0, 0, 0));
    EXPECT_EQ(residual[0], want);
  }
  grad[0] = -2.0f;
  residual[0] = 0.0f;
  ASSERT_TRUE(
      TwoBitQuantize(grad.data(), residual.data(), 1, kT, out.data()).ok());
  EXPECT_THAT(out, ElementsAre(0x80, 0, 0, 0));
  EXPECT_EQ(residual[0], -1.5f);
}

TEST(TwoBitQuantizeTest, ExactlyThresholdCodesAndZeroesTheResidual) {
  std::vector<float> grad = {0.5f, -0.5f, 0.4999999f, -0.4999999f};
  std::vector<float> residual(4, 0.0f);
  std::vector<uint8_t> out(4);
  ASSERT_TRUE(
      TwoBitQuantize(grad.data(), residual.data(), 4, kT, out.data()).ok());
  EXPECT_THAT(out, ElementsAre(0b11100000, 0, 0, 0));
  EXPECT_THAT(residual, ElementsAre(0.0f, 0.0f, 0.4999999f, -0.4999999f));
}

TEST(TwoBitQuantizeTest, RejectsBadThreshold) {
  std::vector<float> grad(4, 1.0f), residual(4, 0.0f);
  std::vector<uint8_t> out(4, 0x11);
  for (float t : {0.0f, -0.0f, -0.5f, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::infinity()}) {
    absl::Status s =
        TwoBitQuantize(grad.data(), residual.data(), 4, t, out.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << t;
    EXPECT_THAT(s.message(), HasSubstr("threshold"));
  }
  // Nothing was written.
  EXPECT_THAT(residual, ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(out, ElementsAre(0x11, 0x11, 0x11, 0x11));
}

TEST(TwoBitQuantizeTest, RejectsNullPointersOnlyWhenThereIsData) {
  float residual = 0;
  uint8_t out[4];
  EXPECT_EQ(TwoBitQuantize(nullptr, &residual, 1, kT, out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TwoBitQuantize(&residual, nullptr, 1, kT, out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TwoBitQuantize(&residual, &residual + 0, 1, kT, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(TwoBitQuantize(nullptr, nullptr, 0, kT, nullptr).ok());
  EXPECT_TRUE(TwoBitDequantize(nullptr, 0, 0, kT, nullptr).ok());
}

TEST(TwoBitDequantizeTest, RejectsBadThreshold) {
  std::vector<uint8_t> in(4, 0);
  std::vector<float> out(3);
  for (float t : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_EQ(TwoBitDequantize(in.data(), 4, 3, t, out.data()).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(TwoBitDequantizeAdd(in.data(), 4, 3, t, out.data()).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(TwoBitDequantizeTest, WrongPayloadSizeIsDataLoss) {
  std::vector<uint8_t> in(12, 0);
  std::vector<float> out(40, 3.0f);
  for (size_t bytes : {0u, 4u, 8u, 11u, 13u}) {
    absl::Status s = TwoBitDequantize(in.data(), bytes, 33, kT, out.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << bytes;
    EXPECT_THAT(s.message(), HasSubstr("expected 12"));
  }
  EXPECT_EQ(TwoBitDequantize(in.data(), 4, 0, kT, out.data()).code(),
            absl::StatusCode::kDataLoss);
  for (float v : out) EXPECT_EQ(v, 3.0f);
}

TEST(TwoBitDequantizeTest, CodeZeroOneIsDataLoss) {
  // Element 5 (byte 1, second slot) carries 0b01.
  std::vector<uint8_t> in = {0xC0, 0b00010000, 0, 0};
  std::vector<float> out(16, 3.0f);
  absl::Status s = TwoBitDequantize(in.data(), 4, 16, kT, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("0b01"));
  EXPECT_THAT(s.message(), HasSubstr("slot 5"));
  s = TwoBitDequantizeAdd(in.data(), 4, 16, kT, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  // Validation happens before any write.
  for (float v : out) EXPECT_EQ(v, 3.0f);
}

TEST(TwoBitDequantizeTest, SetPaddingBitsAreDataLoss) {
  std::vector<float> out(17, 3.0f);
  // 17 elements: the second word holds element 16 in the top two bits of byte
  // 4; every other bit of that word is padding.
  for (int byte = 4; byte < 8; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      if (byte == 4 && bit >= 6) continue;
      std::vector<uint8_t> in(8, 0);
      in[byte] = static_cast<uint8_t>(1u << bit);
      absl::Status s = TwoBitDequantize(in.data(), 8, 17, kT, out.data());
      ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss)
          << "byte " << byte << " bit " << bit;
      EXPECT_THAT(s.message(), HasSubstr("wrong place"));
    }
  }
  for (float v : out) EXPECT_EQ(v, 3.0f);
  // A legal code in the only used slot of the second word is fine.
  std::vector<uint8_t> ok = {0, 0, 0, 0, 0xC0, 0, 0, 0};
  ASSERT_TRUE(TwoBitDequantize(ok.data(), 8, 17, kT, out.data()).ok());
  EXPECT_EQ(out[16], kT);
  // 0b11 in a padding slot (a valid code, wrong place).
  std::vector<uint8_t> padded = {0, 0, 0, 0, 0xF0, 0, 0, 0};
  EXPECT_EQ(TwoBitDequantize(padded.data(), 8, 17, kT, out.data()).code(),
            absl::StatusCode::kDataLoss);
}

TEST_P(TwoBitSimdTest, AddAccumulatesIntoOutput) {
  const std::vector<float> grad = {0.6f,  -0.7f, 0.2f, 0.5f,
                                   -0.5f, 0.49f, 1.0f, -2.0f};
  std::vector<float> residual(grad.size(), 0.0f);
  std::vector<uint8_t> wire(TwoBitCompressedBytes(grad.size()));
  ASSERT_TRUE(
      TwoBitQuantize(grad.data(), residual.data(), grad.size(), kT, wire.data())
          .ok());
  std::vector<float> sum = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_TRUE(
      TwoBitDequantizeAdd(wire.data(), wire.size(), 8, kT, sum.data()).ok());
  EXPECT_THAT(sum, ElementsAre(1.5f, 1.5f, 3.0f, 4.5f, 4.5f, 6.0f, 7.5f, 7.5f));
  ASSERT_TRUE(
      TwoBitDequantizeAdd(wire.data(), wire.size(), 8, kT, sum.data()).ok());
  EXPECT_THAT(sum, ElementsAre(2.0f, 1.0f, 3.0f, 5.0f, 4.0f, 6.0f, 8.0f, 7.0f));
}

TEST_P(TwoBitSimdTest, AddMatchesDequantizeOnLongArrays) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t len : {1u, 31u, 4097u}) {
    std::vector<float> grad(len), residual(len, 0.0f), base(len);
    for (size_t i = 0; i < len; ++i) {
      grad[i] = normal(rng);
      base[i] = normal(rng);
    }
    std::vector<uint8_t> wire(TwoBitCompressedBytes(len));
    ASSERT_TRUE(
        TwoBitQuantize(grad.data(), residual.data(), len, kT, wire.data())
            .ok());
    std::vector<float> decoded(len), sum = base;
    ASSERT_TRUE(
        TwoBitDequantize(wire.data(), wire.size(), len, kT, decoded.data())
            .ok());
    ASSERT_TRUE(
        TwoBitDequantizeAdd(wire.data(), wire.size(), len, kT, sum.data())
            .ok());
    for (size_t i = 0; i < len; ++i) ASSERT_EQ(sum[i], base[i] + decoded[i]);
  }
}

// The cluster vector from the reference with one worker (n = 1): pushes 0, 0.4,
// 0.1, 0.2, 0.3, 0.5 of one scalar, applied as w += 2 * decoded, pull 0, 0, n,
// n, 2n, 3n.
TEST(TwoBitQuantizeTest, ScalarPushSequenceFromTheReference) {
  std::vector<float> residual(1, 0.0f);
  std::vector<uint8_t> wire(4);
  float pulled = 0.0f;  // One worker (n = 1), w += 2 * decoded.
  std::vector<float> pulls;
  for (float g : {0.0f, 0.4f, 0.1f, 0.2f, 0.3f, 0.5f}) {
    ASSERT_TRUE(TwoBitQuantize(&g, residual.data(), 1, kT, wire.data()).ok());
    float decoded = 0.0f;
    ASSERT_TRUE(TwoBitDequantize(wire.data(), 4, 1, kT, &decoded).ok());
    pulled += 2.0f * decoded;
    pulls.push_back(pulled);
  }
  EXPECT_THAT(pulls, ElementsAre(0.0f, 0.0f, 1.0f, 1.0f, 2.0f, 3.0f));
}

}  // namespace
}  // namespace tessera::compression
