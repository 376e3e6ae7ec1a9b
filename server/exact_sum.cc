#include "server/exact_sum.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"
#include "common/compression/two_bit_kernels.h"

namespace tessera {
namespace {

constexpr int kLimbs = 5;
constexpr uint64_t kBlock = 64;

// Adds (negative: subtracts) m * 2^shift to the two's complement `limb`.
void AddShifted(uint64_t* limb, uint64_t m, int shift, bool negative) {
  const int idx = shift / 64;
  const int off = shift % 64;
  uint64_t part[kLimbs] = {0, 0, 0, 0, 0};
  part[idx] = m << off;
  if (off != 0 && idx + 1 < kLimbs) part[idx + 1] = m >> (64 - off);
  if (!negative) {
    unsigned __int128 carry = 0;
    for (int i = 0; i < kLimbs; ++i) {
      const unsigned __int128 s =
          static_cast<unsigned __int128>(limb[i]) + part[i] + carry;
      limb[i] = static_cast<uint64_t>(s);
      carry = s >> 64;
    }
  } else {
    uint64_t borrow = 0;
    for (int i = 0; i < kLimbs; ++i) {
      const uint64_t a = limb[i];
      const uint64_t d = a - part[i] - borrow;
      borrow = (a < part[i]) || (a - part[i] < borrow) ? 1 : 0;
      limb[i] = d;
    }
  }
}

// sum[i] = a[i] + v[i] for i < n, the additions checked with Knuth's TwoSum:
// false when any of them rounded or was not finite (its error term is then
// non-zero or NaN). Written for the vectoriser.
bool SumBlockExactly(const double* __restrict a, const float* __restrict v,
                     double* __restrict sum, uint64_t n) {
  uint64_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const double x = a[i];
    const double y = v[i];
    const double s = x + y;
    const double bb = s - x;
    const double err = (x - (s - bb)) + (y - bb);
    sum[i] = s;
    uint64_t bits;
    std::memcpy(&bits, &err, sizeof(bits));
    bad |= bits << 1;  // -0 is exact too
  }
  return bad == 0;
}

}  // namespace

void ExactSum::Wide::AddFloat(float v) {
  if (std::isnan(v)) {
    nan = true;
    return;
  }
  if (std::isinf(v)) {
    (v > 0 ? pos_inf : neg_inf) = true;
    return;
  }
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t exponent = (bits >> 23) & 0xff;
  const uint32_t fraction = bits & 0x7fffff;
  if (exponent == 0 && fraction == 0) return;  // +-0
  // |v| = m * 2^(shift - 149): a subnormal is fraction * 2^-149.
  const uint64_t m = exponent == 0 ? fraction : (fraction | 0x800000u);
  const int shift = exponent == 0 ? 0 : static_cast<int>(exponent) - 1;
  AddShifted(limb, m, shift, (bits >> 31) != 0);
}

void ExactSum::Wide::AddDouble(double d) {
  if (d == 0) return;
  int e = 0;
  const double f = std::frexp(std::fabs(d), &e);  // |d| = f * 2^e
  uint64_t m = static_cast<uint64_t>(std::ldexp(f, 53));  // exact
  int shift = e - 53 + 149;  // in units of 2^-149
  if (shift < 0) {
    m >>= -shift;  // exact: d is a multiple of 2^-149
    shift = 0;
  }
  AddShifted(limb, m, shift, d < 0);
}

float ExactSum::Wide::Round() const {
  if (nan || (pos_inf && neg_inf))
    return std::numeric_limits<float>::quiet_NaN();
  if (pos_inf) return std::numeric_limits<float>::infinity();
  if (neg_inf) return -std::numeric_limits<float>::infinity();
  const bool negative = (limb[kLimbs - 1] >> 63) != 0;
  uint64_t mag[kLimbs];
  std::memcpy(mag, limb, sizeof(mag));
  if (negative) {  // two's complement negation
    uint64_t carry = 1;
    for (int i = 0; i < kLimbs; ++i) {
      mag[i] = ~mag[i] + carry;
      carry = (carry != 0 && mag[i] == 0) ? 1 : 0;
    }
  }
  int top = -1;  // highest set bit
  for (int i = kLimbs - 1; i >= 0 && top < 0; --i) {
    if (mag[i] != 0) top = 64 * i + 63 - __builtin_clzll(mag[i]);
  }
  if (top < 0) return 0.0f;
  auto bit = [&mag](int pos) -> uint64_t {
    return pos < 0 ? 0 : (mag[pos / 64] >> (pos % 64)) & 1;
  };
  float magnitude;
  if (top < 24) {
    // Below 2^-125: exactly a float (subnormal, or the smallest normals).
    magnitude = std::ldexp(static_cast<float>(mag[0]), -149);
  } else {
    // 24 significant bits, then round to nearest, ties to even.
    uint64_t keep = 0;
    for (int pos = top; pos > top - 24; --pos) keep = (keep << 1) | bit(pos);
    const uint64_t guard = bit(top - 24);
    bool sticky = false;
    for (int pos = top - 25; pos >= 0 && !sticky; --pos) {
      if (pos % 64 == 63 && mag[pos / 64] == 0) {
        pos -= 63;  // a whole zero limb
        continue;
      }
      sticky = bit(pos) != 0;
    }
    int exponent = top - 23 - 149;
    if (guard && (sticky || (keep & 1))) {
      if (++keep == (uint64_t{1} << 24)) {
        keep >>= 1;
        ++exponent;
      }
    }
    // Exact in double; the cast is exact, or infinity past the float range.
    magnitude = static_cast<float>(std::ldexp(static_cast<double>(keep),
                                              exponent));
  }
  return negative ? -magnitude : magnitude;
}

ExactSum::ExactSum(uint64_t length)
    : length_(length),
      acc_(length),
      wide_bits_((length + kBlock - 1) / kBlock, 0) {}

void ExactSum::Grow(uint64_t length) {
  if (empty_) {
    acc_.assign(length, 0.0);
    empty_ = false;
  } else {
    acc_.resize(length, 0.0);
  }
  length_ = length;
  wide_bits_.resize((length + kBlock - 1) / kBlock, 0);
}

void ExactSum::AddAt(uint64_t begin, const float* values, uint64_t count) {
  const uint64_t end = begin + count;
  for (uint64_t at = begin; at < end;) {
    const uint64_t block_end = std::min(end, (at / kBlock + 1) * kBlock);
    AddRange(at, block_end, values + (at - begin));
    at = block_end;
  }
}

void ExactSum::AddSlow(uint64_t i, float v) {
  Wide& w = wide_[i];
  if (!IsWide(i)) {
    w.AddDouble(acc_[i]);
    wide_bits_[i / kBlock] |= uint64_t{1} << (i % kBlock);
  }
  w.AddFloat(v);
}

void ExactSum::AddFloats(const float* v) {
  double* a = acc_.data();
  if (empty_) {
    empty_ = false;
    for (uint64_t i = 0; i < length_; ++i) {
      if (std::isfinite(v[i])) {
        a[i] = v[i];
      } else {
        a[i] = 0;
        AddSlow(i, v[i]);
      }
    }
    return;
  }
  for (uint64_t begin = 0; begin < length_; begin += kBlock)
    AddRange(begin, std::min(begin + kBlock, length_), v + begin);
}

void ExactSum::AddRange(uint64_t begin, uint64_t end, const float* v) {
  double* a = acc_.data();
  if (wide_bits_[begin / kBlock] == 0) {
    double sum[kBlock];
    if (SumBlockExactly(a + begin, v, sum, end - begin)) {
      std::memcpy(a + begin, sum, (end - begin) * sizeof(double));
      return;
    }
  }
  for (uint64_t i = begin; i < end; ++i) {
    const float y = v[i - begin];
    if (IsWide(i)) {
      wide_[i].AddFloat(y);
      continue;
    }
    const double x = a[i];
    const double s = x + y;
    const double bb = s - x;
    const double err = (x - (s - bb)) + (y - bb);
    if (err == 0.0) {
      a[i] = s;
    } else {
      AddSlow(i, y);
    }
  }
}

absl::Status ExactSum::AddTwoBit(const uint8_t* in, size_t in_bytes,
                                 float threshold) {
  namespace k = compression::kernels;
  if (!(threshold > 0 && std::isfinite(threshold))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "2-bit threshold ", threshold, ": expected a number > 0"));
  }
  if (in_bytes != compression::TwoBitCompressedBytes(length_)) {
    return absl::DataLossError(absl::StrCat(
        "2-bit payload of ", in_bytes, " bytes for ", length_,
        " values; expected ", compression::TwoBitCompressedBytes(length_)));
  }
  for (size_t b = 0; b < in_bytes; ++b) {
    const uint32_t bad = k::CheckByte(in[b], k::ElementsInByte(b, length_));
    if (bad != 0) {
      return absl::DataLossError(absl::StrCat(
          "2-bit payload byte ", b,
          (bad & k::kBadCodeFlag) ? " holds the code 0b01"
                                  : " sets a bit past the last value"));
    }
  }
  // Decoded a block at a time into floats (four per payload byte, from a
  // table), then added as any push.
  float table[256][4];
  for (uint32_t byte = 0; byte < 256; ++byte)
    k::DequantizeByte(byte, 4, threshold, -threshold, table[byte]);
  float decoded[kBlock];
  for (uint64_t begin = 0; begin < length_; begin += kBlock) {
    const uint64_t end = std::min(begin + kBlock, length_);
    const uint64_t bytes = (end - begin + 3) / 4;
    for (uint64_t b = 0; b < bytes; ++b)
      std::memcpy(decoded + 4 * b, table[in[begin / 4 + b]], 4 * sizeof(float));
    if (empty_) {
      double* a = acc_.data();
      for (uint64_t i = begin; i < end; ++i) a[i] = decoded[i - begin];
      if (end == length_) empty_ = false;
      continue;
    }
    AddRange(begin, end, decoded);
  }
  return absl::OkStatus();
}

const float* ExactSum::Finish() {
  unsigned char* bytes = reinterpret_cast<unsigned char*>(acc_.data());
  for (uint64_t i = 0; i < length_; ++i) {
    float r = 0.0f;
    if (!empty_) {
      if (IsWide(i)) {
        r = wide_.at(i).Round();
      } else {
        double d;
        std::memcpy(&d, bytes + i * sizeof(double), sizeof(d));
        r = static_cast<float>(d);
      }
    }
    // Front to back: float i lands on bytes the doubles before i held.
    std::memcpy(bytes + i * sizeof(float), &r, sizeof(r));
  }
  wide_.clear();
  std::fill(wide_bits_.begin(), wide_bits_.end(), 0);
  empty_ = true;
  return reinterpret_cast<const float*>(bytes);
}

}  // namespace tessera
