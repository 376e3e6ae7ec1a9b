// The 2-bit GPU kernels' arithmetic (two_bit_kernels.h), run on the host: each
// test runs the kernels' per-byte bodies over every byte of a payload, as the
// grid would, and checks them bit for bit against the CPU codec (two_bit.h) on
// both of its SIMD paths: packed bytes, residuals (NaN and infinities
// included), decoded floats and the verdict on malformed payloads. The kernels
// claim bit-identity with the CPU codec, so every comparison is exact, except
// that a NaN residual matches any NaN (see SameFloat).
#include "common/compression/two_bit_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/compression/two_bit.h"
#include "common/compression/two_bit_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/compression/two_bit_reference.h"

namespace tessera::compression {
namespace {

using ::testing::ElementsAre;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// The same float bit for bit, except that any NaN equals any NaN: the CPU
// passes an operand's payload on, a GPU need not (NVIDIA's return a canonical
// NaN), so the codec promises a NaN residual, not its payload.
bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || Bits(a) == Bits(b);
}

// What QuantizeKernel computes: thread b writes byte b, for every byte of the
// payload (padding bytes included). The kernel's float4 path runs QuantizeByte
// on the same four elements with valid == 4, which is what
// QuantizePayloadByte does for a full byte.
void QuantizeLikeTheKernel(const std::vector<float>& grad,
                           std::vector<float>& residual, float t,
                           std::vector<uint8_t>& out) {
  const size_t len = grad.size();
  out.assign(TwoBitCompressedBytes(len), 0xAB);  // Every byte must be written.
  for (size_t b = 0; b < out.size(); ++b) {
    out[b] = kernels::QuantizePayloadByte(grad.data(), residual.data(), len, b,
                                          t, -t);
  }
}

// What DequantizeKernel computes, and the flags it OR-s together.
uint32_t DequantizeLikeTheKernel(const std::vector<uint8_t>& in, size_t len,
                                 float t, std::vector<float>& out) {
  out.assign(len, 99.0f);
  uint32_t flags = 0;
  for (size_t b = 0; b < in.size(); ++b) {
    flags |=
        kernels::DequantizePayloadByte(in.data(), len, b, t, -t, out.data());
  }
  return flags;
}

// The CPU codec's verdict as TwoBitDequantizeDevice words it from the flags:
// padding first, then the code 0b01.
std::string VerdictFromFlags(uint32_t flags) {
  if (flags & kernels::kBadPaddingFlag) return "wrong place";
  if (flags & kernels::kBadCodeFlag) return "0b01";
  return "ok";
}

std::string CpuVerdict(const absl::Status& s) {
  if (s.ok()) return "ok";
  if (s.code() != absl::StatusCode::kDataLoss) return s.ToString();
  if (absl::StrContains(s.message(), "wrong place")) return "wrong place";
  if (absl::StrContains(s.message(), "0b01")) return "0b01";
  return s.ToString();
}

// Runs the CPU codec on its run-time pick (AVX2 where present) or forced onto
// its baseline loop.
class ScopedBaselineSimd {
 public:
  explicit ScopedBaselineSimd(bool baseline) {
    ForceBaselineSimdForTesting(baseline);
  }
  ~ScopedBaselineSimd() { ForceBaselineSimdForTesting(false); }
};

class TwoBitKernelsTest : public ::testing::TestWithParam<bool> {
 protected:
  ScopedBaselineSimd simd_{GetParam()};

  // Quantizes `grad` from `residual` with the kernel bodies and the CPU codec
  // and expects the same bytes and the same residual bits; leaves the
  // kernel's residual in `residual` and returns the kernel's bytes.
  std::vector<uint8_t> ExpectQuantizeMatchesCpu(const std::vector<float>& grad,
                                                std::vector<float>& residual,
                                                float t,
                                                const std::string& what) {
    std::vector<float> cpu_residual = residual;
    std::vector<uint8_t> cpu_out(TwoBitCompressedBytes(grad.size()), 0xCD);
    EXPECT_TRUE(TwoBitQuantize(grad.data(), cpu_residual.data(), grad.size(), t,
                               cpu_out.data())
                    .ok());
    std::vector<uint8_t> out;
    QuantizeLikeTheKernel(grad, residual, t, out);
    EXPECT_EQ(out, cpu_out) << what;
    size_t mismatches = 0;
    for (size_t i = 0; i < grad.size(); ++i) {
      if (SameFloat(residual[i], cpu_residual[i])) continue;
      if (++mismatches <= 5) {
        ADD_FAILURE() << what << " element " << i << ": residual "
                      << residual[i] << " vs CPU " << cpu_residual[i];
      }
    }
    return out;
  }
};

INSTANTIATE_TEST_SUITE_P(CpuPaths, TwoBitKernelsTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Baseline" : "Dispatched";
                         });

TEST(TwoBitKernelsLayoutTest, ShiftsFollowTheFormat) {
  // First element of a byte in its two highest bits.
  EXPECT_EQ(kernels::ByteShift(0), 6u);
  EXPECT_EQ(kernels::ByteShift(3), 0u);
  for (size_t j = 0; j < kTwoBitElementsPerWord; ++j) {
    EXPECT_EQ(kernels::WordShift(j), 8 * (j / 4) + kernels::ByteShift(j % 4))
        << j;
  }
  EXPECT_EQ(kernels::UsedBitsOfByte(0), 0x00u);
  EXPECT_EQ(kernels::UsedBitsOfByte(1), 0xC0u);
  EXPECT_EQ(kernels::UsedBitsOfByte(3), 0xFCu);
  EXPECT_EQ(kernels::UsedBitsOfByte(4), 0xFFu);
  EXPECT_EQ(kernels::ElementsInByte(0, 0), 0u);
  EXPECT_EQ(kernels::ElementsInByte(0, 3), 3u);
  EXPECT_EQ(kernels::ElementsInByte(4, 17), 1u);
  EXPECT_EQ(kernels::ElementsInByte(5, 17), 0u);
  EXPECT_EQ(kernels::ElementsInByte(2, 1000), 4u);
}

// MXNet's vectors (/work/shared/reference/kvstore-semantics.md), through the
// kernel bodies.
TEST_P(TwoBitKernelsTest, MxnetReferenceVectors) {
  const std::vector<float> grad = {0.6f,  -0.7f, 0.2f, 0.5f,
                                   -0.5f, 0.49f, 1.0f, -2.0f};
  std::vector<float> residual(grad.size(), 0.0f);
  ExpectQuantizeMatchesCpu(grad, residual, 0.5f, "eight elements");
  std::vector<float> zero(grad.size(), 0.0f);
  std::vector<uint8_t> out;
  QuantizeLikeTheKernel(grad, zero, 0.5f, out);
  EXPECT_THAT(out, ElementsAre(0xE3, 0x8E, 0x00, 0x00));
  std::vector<float> decoded;
  EXPECT_EQ(DequantizeLikeTheKernel(out, grad.size(), 0.5f, decoded), 0u);
  EXPECT_THAT(decoded,
              ElementsAre(0.5f, -0.5f, 0.0f, 0.5f, -0.5f, 0.0f, 0.5f, -0.5f));

  const std::vector<float> ones(17, 1.0f);
  std::vector<float> ones_residual(17, 0.0f);
  ExpectQuantizeMatchesCpu(ones, ones_residual, 0.5f, "seventeen ones");
  std::vector<float> fresh(17, 0.0f);
  QuantizeLikeTheKernel(ones, fresh, 0.5f, out);
  EXPECT_THAT(out, ElementsAre(0xFF, 0xFF, 0xFF, 0xFF, 0xC0, 0x00, 0x00, 0x00));

  // The cluster sequence with one worker (w += 2 * decoded): pushes 0, 0.4,
  // 0.1, 0.2, 0.3, 0.5 pull 0, 0, 1, 1, 2, 3.
  std::vector<float> r(1, 0.0f);
  float pulled = 0.0f;
  std::vector<float> pulls;
  for (float g : {0.0f, 0.4f, 0.1f, 0.2f, 0.3f, 0.5f}) {
    const std::vector<uint8_t> wire =
        ExpectQuantizeMatchesCpu({g}, r, 0.5f, "scalar sequence");
    std::vector<float> decoded;
    ASSERT_EQ(DequantizeLikeTheKernel(wire, 1, 0.5f, decoded), 0u);
    pulled += 2.0f * decoded[0];
    pulls.push_back(pulled);
  }
  EXPECT_THAT(pulls, ElementsAre(0.0f, 0.0f, 1.0f, 1.0f, 2.0f, 3.0f));
}

TEST_P(TwoBitKernelsTest, RandomPushesOnOddLengths) {
  std::mt19937 rng(20240611);
  std::normal_distribution<float> normal(0.0f, 0.6f);
  for (size_t len : {0u, 1u, 2u, 3u, 4u, 5u, 7u, 15u, 16u, 17u, 31u, 32u, 33u,
                     63u, 65u, 255u, 1000u, 4097u, 65537u}) {
    for (float t : {0.5f, 0.1f, 1.0f, 0.013f, 1e-3f}) {
      std::vector<float> grad(len), residual(len);
      for (float& r : residual) r = normal(rng);
      for (int push = 0; push < 3; ++push) {
        for (float& g : grad) g = normal(rng);
        ExpectQuantizeMatchesCpu(grad, residual, t,
                                 "len " + std::to_string(len) + " t " +
                                     std::to_string(t) + " push " +
                                     std::to_string(push));
      }
    }
  }
}

// Values at and around the threshold, signed zeros, denormals, the float
// range's ends, infinities and NaN: the kernel bodies do what the CPU codec
// does, bit for bit. A NaN residual codes 0b00 and stays NaN; an infinite one
// codes +-t and stays infinite.
TEST_P(TwoBitKernelsTest, EdgeValues) {
  const float t = 0.5f;
  const std::vector<float> edges = {0.0f,
                                    -0.0f,
                                    t,
                                    -t,
                                    std::nextafter(t, 0.0f),
                                    std::nextafter(t, kInf),
                                    std::nextafter(-t, 0.0f),
                                    std::nextafter(-t, -kInf),
                                    2 * t,
                                    -2 * t,
                                    1e-40f,
                                    -1e-40f,
                                    std::numeric_limits<float>::denorm_min(),
                                    std::numeric_limits<float>::min(),
                                    std::numeric_limits<float>::max(),
                                    std::numeric_limits<float>::lowest(),
                                    kInf,
                                    -kInf,
                                    kNaN,
                                    -kNaN,
                                    1e30f,
                                    -1e30f,
                                    0.25f,
                                    -0.75f};
  // Every ordered pair (residual, grad) once, in a length that is not a
  // multiple of 16, then three more pushes of the edges over what is left.
  std::vector<float> residual, grad;
  for (float r : edges) {
    for (float g : edges) {
      residual.push_back(r);
      grad.push_back(g);
    }
  }
  residual.push_back(0.0f);
  grad.push_back(t);
  ASSERT_NE(grad.size() % 16, 0u);
  for (int push = 0; push < 4; ++push) {
    ExpectQuantizeMatchesCpu(grad, residual, t, "push " + std::to_string(push));
    std::rotate(grad.begin(), grad.begin() + 1, grad.end());
  }

  // Exactly +-t codes and leaves zero; NaN codes 0 and stays NaN; inf codes
  // +t and stays inf.
  std::vector<float> r = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  std::vector<uint8_t> out;
  QuantizeLikeTheKernel({t, -t, kNaN, kInf, -kInf}, r, t, out);
  EXPECT_THAT(out, ElementsAre(0b11100011, 0b10000000, 0, 0));
  EXPECT_EQ(r[0], 0.0f);
  EXPECT_EQ(r[1], 0.0f);
  EXPECT_TRUE(std::isnan(r[2]));
  EXPECT_EQ(r[3], kInf);
  EXPECT_EQ(r[4], -kInf);
}

TEST_P(TwoBitKernelsTest, ThresholdsAcrossTheFloatRange) {
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> exponent(-38.0f, 38.0f);
  std::uniform_real_distribution<float> unit(-2.0f, 2.0f);
  for (float t : {1e-38f, 1e-20f, 3.0f, 1e20f, 3e38f}) {
    std::vector<float> grad(37), residual(37, 0.0f);
    for (int push = 0; push < 3; ++push) {
      for (float& g : grad) g = unit(rng) * std::pow(10.0f, exponent(rng));
      ExpectQuantizeMatchesCpu(grad, residual, t, "t " + std::to_string(t));
    }
  }
}

// Well-formed payloads: the dequantize bodies decode what the CPU decodes.
TEST_P(TwoBitKernelsTest, DequantizeMatchesCpu) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t len : {1u, 3u, 4u, 15u, 16u, 17u, 33u, 1001u, 65537u}) {
    for (float t : {0.5f, 0.013f, 3e38f}) {
      std::vector<float> grad(len), residual(len, 0.0f);
      for (float& g : grad) g = normal(rng);
      std::vector<uint8_t> wire(TwoBitCompressedBytes(len));
      ASSERT_TRUE(
          TwoBitQuantize(grad.data(), residual.data(), len, 0.5f, wire.data())
              .ok());
      std::vector<float> cpu(len);
      ASSERT_TRUE(
          TwoBitDequantize(wire.data(), wire.size(), len, t, cpu.data()).ok());
      std::vector<float> kernel;
      ASSERT_EQ(DequantizeLikeTheKernel(wire, len, t, kernel), 0u);
      for (size_t i = 0; i < len; ++i) {
        ASSERT_EQ(Bits(kernel[i]), Bits(cpu[i])) << "len " << len << " " << i;
      }
      EXPECT_EQ(kernel, testing_reference::Dequantize(wire, len, t));
    }
  }
}

// Every value of every byte of a one- and a two-word payload, for every length
// that makes that byte partly or wholly padding: the kernels reject exactly
// what the CPU rejects, with the same reason, and decode the rest alike.
TEST_P(TwoBitKernelsTest, EveryByteValueGetsTheCpuVerdict) {
  for (size_t len = 1; len <= 32; ++len) {
    const size_t bytes = TwoBitCompressedBytes(len);
    for (size_t pos = 0; pos < bytes; ++pos) {
      for (uint32_t value = 0; value < 256; ++value) {
        std::vector<uint8_t> in(bytes, 0);
        in[pos] = static_cast<uint8_t>(value);
        std::vector<float> cpu(len, 99.0f);
        const absl::Status s =
            TwoBitDequantize(in.data(), in.size(), len, 0.5f, cpu.data());
        std::vector<float> kernel;
        const uint32_t flags = DequantizeLikeTheKernel(in, len, 0.5f, kernel);
        ASSERT_EQ(VerdictFromFlags(flags), CpuVerdict(s))
            << "len " << len << " byte " << pos << " value " << value;
        if (s.ok()) {
          for (size_t i = 0; i < len; ++i) {
            ASSERT_EQ(Bits(kernel[i]), Bits(cpu[i]));
          }
        }
      }
    }
  }
}

// Random garbage, as a peer might send: same verdicts. A payload may hold both
// faults; the CPU and the GPU entry point both name the padding first.
TEST_P(TwoBitKernelsTest, RandomPayloadsGetTheCpuVerdict) {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> sparse(0, 15);
  int rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const size_t len = 1 + static_cast<size_t>(trial % 97);
    std::vector<uint8_t> in(TwoBitCompressedBytes(len));
    // Mostly valid codes (0b00, 0b10, 0b11) with the odd bad bit.
    for (uint8_t& b : in) {
      uint32_t v = 0;
      for (int k = 0; k < 4; ++k) {
        const uint32_t codes[3] = {0b00, 0b10, 0b11};
        v |= codes[byte(rng) % 3] << (6 - 2 * k);
      }
      if (sparse(rng) == 0) v ^= 1u << (byte(rng) % 8);
      b = static_cast<uint8_t>(v);
    }
    // Clear the padding most of the time so both verdicts get exercised.
    if (trial % 3 != 0) {
      for (size_t b = 0; b < in.size(); ++b) {
        in[b] &= kernels::UsedBitsOfByte(kernels::ElementsInByte(b, len));
      }
    }
    std::vector<float> cpu(len);
    const absl::Status s =
        TwoBitDequantize(in.data(), in.size(), len, 0.5f, cpu.data());
    std::vector<float> kernel;
    const uint32_t flags = DequantizeLikeTheKernel(in, len, 0.5f, kernel);
    ASSERT_EQ(VerdictFromFlags(flags), CpuVerdict(s)) << "trial " << trial;
    rejected += s.ok() ? 0 : 1;
    if (s.ok()) {
      for (size_t i = 0; i < len; ++i) ASSERT_EQ(Bits(kernel[i]), Bits(cpu[i]));
    }
  }
  // Both outcomes occurred.
  EXPECT_GT(rejected, 100);
  EXPECT_LT(rejected, 2900);
}

TEST(TwoBitKernelsCheckByteTest, FlagsNameTheFault) {
  EXPECT_EQ(kernels::CheckByte(0xE3, 4), 0u);
  EXPECT_EQ(kernels::CheckByte(0x40, 4), kernels::kBadCodeFlag);
  EXPECT_EQ(kernels::CheckByte(0xC0, 1), 0u);
  EXPECT_EQ(kernels::CheckByte(0xF0, 1), kernels::kBadPaddingFlag);
  EXPECT_EQ(kernels::CheckByte(0x41, 1),
            kernels::kBadCodeFlag | kernels::kBadPaddingFlag);
  EXPECT_EQ(kernels::CheckByte(0x01, 0), kernels::kBadPaddingFlag);
  EXPECT_EQ(kernels::CheckByte(0x00, 0), 0u);
}

TEST(TwoBitKernelsElementTest, DecodeElementMapsEveryCode) {
  EXPECT_EQ(kernels::DecodeElement(kernels::kCodePlus, 0.5f, -0.5f), 0.5f);
  EXPECT_EQ(kernels::DecodeElement(kernels::kCodeMinus, 0.5f, -0.5f), -0.5f);
  EXPECT_EQ(Bits(kernels::DecodeElement(kernels::kCodeZero, 0.5f, -0.5f)),
            Bits(0.0f));
}

}  // namespace
}  // namespace tessera::compression
